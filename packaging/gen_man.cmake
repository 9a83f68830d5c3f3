# Writes the ckptfs(1) man page from the built binary's --help output and the
# prose in packaging/ckptfs.1.in, so the page lists exactly the flags the
# binary accepts.
#   cmake -DCKPTFS=build/ckptfs -DTEMPLATE=packaging/ckptfs.1.in
#         -DOUT=build/ckptfs.1 -DVERSION=0.1.0 -P packaging/gen_man.cmake
#
# CLI11 help text is a description line, a "Usage:" line, then sections:
# "Positionals:", "Options:" and "Subcommands:" list one item per line as
# "  TERM<two or more spaces>DESCRIPTION" (longer descriptions may continue on
# deeper-indented lines); anything else (the footer: examples, exit status)
# is kept verbatim.
cmake_minimum_required(VERSION 3.20)
foreach(var CKPTFS TEMPLATE OUT VERSION)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "gen_man.cmake: -D${var}=... is required")
  endif()
endforeach()

# Runs `ckptfs ARGS --help`; the text comes back escaped for troff and split
# into a CMake list of lines (see escape_lines).
function(help_lines out_var)
  execute_process(COMMAND ${CKPTFS} ${ARGN} --help
                  OUTPUT_VARIABLE text ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${CKPTFS} ${ARGN} --help exited with ${rc}: ${err}")
  endif()
  # CLI11 prints argv[0] in the Usage line: the page names the command.
  string(REPLACE "${CKPTFS}" "ckptfs" text "${text}")
  escape_lines("${text}" lines)
  set(${out_var} "${lines}" PARENT_SCOPE)
endfunction()

# troff: a backslash is \e, a minus that must stay a minus (flags) is \-.
# CMake lists: ';' separates items and unbalanced '[' ']' would join them, so
# all three are replaced by markers that restore() turns back.
function(escape_lines text out_var)
  string(REPLACE "\\" "\\e" text "${text}")
  string(REPLACE "-" "\\-" text "${text}")
  string(REPLACE ";" "@SEMI@" text "${text}")
  string(REPLACE "[" "@LBR@" text "${text}")
  string(REPLACE "]" "@RBR@" text "${text}")
  string(REGEX REPLACE "\n+$" "" text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  set(${out_var} "${lines}" PARENT_SCOPE)
endfunction()

function(restore var)
  string(REPLACE "@SEMI@" ";" text "${${var}}")
  string(REPLACE "@LBR@" "[" text "${text}")
  string(REPLACE "@RBR@" "]" text "${text}")
  set(${var} "${text}" PARENT_SCOPE)
endfunction()

# One list item as a tagged paragraph: the flag bold, its value type italic.
function(item_troff term desc out_var)
  if(term MATCHES "^([^ ]+) (.+)$")
    set(tag "\\fB${CMAKE_MATCH_1}\\fR \\fI${CMAKE_MATCH_2}\\fR")
  else()
    set(tag "\\fB${term}\\fR")
  endif()
  set(${out_var} ".TP\n\\&${tag}\n\\&${desc}\n" PARENT_SCOPE)
endfunction()

# Turns the lines after "Usage:" into troff. Sets ${prefix}_LISTS (the
# Positionals/Options items), ${prefix}_FOOTER (verbatim text) and
# ${prefix}_NAMES (the Subcommands' names).
function(sections_troff lines prefix)
  set(mode none)
  set(lists "")
  set(footer "")
  set(names "")
  set(term "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^(Positionals|Options|Subcommands):$")
      set(mode ${CMAKE_MATCH_1})
      if(NOT mode STREQUAL "Subcommands")
        string(APPEND lists ".PP\n\\fB${CMAKE_MATCH_1}:\\fR\n")
      endif()
    elseif(mode MATCHES "^(Positionals|Options|Subcommands)$" AND line MATCHES "^  ([^ ]+( [^ ]+)*)( +(.*))?$")
      if(NOT term STREQUAL "")
        item_troff("${term}" "${desc}" t)
        string(APPEND lists "${t}")
      endif()
      set(term "${CMAKE_MATCH_1}")
      set(desc "${CMAKE_MATCH_4}")
      if(mode STREQUAL "Subcommands")
        list(APPEND names "${term}")
        set(term "")
      endif()
    elseif(mode MATCHES "^(Positionals|Options)$" AND line MATCHES "^     +(.*)$")
      string(APPEND desc " ${CMAKE_MATCH_1}")
    elseif(mode MATCHES "^(Positionals|Options|Subcommands)$" AND line STREQUAL "")
      set(mode none)
    elseif(NOT (mode STREQUAL "none" AND line STREQUAL ""))
      set(mode footer)
      string(APPEND footer "\\&${line}\n")
    endif()
    if(NOT term STREQUAL "" AND NOT mode MATCHES "^(Positionals|Options)$")
      item_troff("${term}" "${desc}" t)
      string(APPEND lists "${t}")
      set(term "")
    endif()
  endforeach()
  if(NOT term STREQUAL "")
    item_troff("${term}" "${desc}" t)
    string(APPEND lists "${t}")
  endif()
  if(NOT footer STREQUAL "")
    set(footer ".PP\n.nf\n.RS 4\n${footer}.RE\n.fi\n")
  endif()
  set(${prefix}_LISTS "${lists}" PARENT_SCOPE)
  set(${prefix}_FOOTER "${footer}" PARENT_SCOPE)
  set(${prefix}_NAMES "${names}" PARENT_SCOPE)
endfunction()

# Splits "description; Usage: ...; rest" off a help text.
macro(split_help lines)
  list(GET ${lines} 0 DESCRIPTION)
  list(GET ${lines} 1 USAGE)
  if(NOT USAGE MATCHES "^Usage: ")
    message(FATAL_ERROR "gen_man.cmake: expected a Usage: line, got '${USAGE}'")
  endif()
  string(REGEX REPLACE "^Usage: " "" USAGE "${USAGE}")
  list(SUBLIST ${lines} 2 -1 REST)
endmacro()

help_lines(top)
split_help(top)
sections_troff("${REST}" TOP)
if(TOP_NAMES STREQUAL "")
  message(FATAL_ERROR "gen_man.cmake: `${CKPTFS} --help` lists no subcommands")
endif()
set(SYNOPSIS "\\&${USAGE}")
set(GLOBAL_OPTIONS "${TOP_LISTS}")
set(EXAMPLES "${TOP_FOOTER}")
# The section is titled EXAMPLES already: drop --help's own heading line.
string(REPLACE "\\&Examples:\n" "" EXAMPLES "${EXAMPLES}")

set(COMMANDS "")
foreach(name IN LISTS TOP_NAMES)
  string(REPLACE "\\-" "-" arg "${name}")
  help_lines(sub ${arg})
  split_help(sub)
  sections_troff("${REST}" SUB)
  string(APPEND COMMANDS ".SS \"${USAGE}\"\n\\&${DESCRIPTION}\n${SUB_LISTS}${SUB_FOOTER}")
endforeach()

foreach(var SYNOPSIS GLOBAL_OPTIONS EXAMPLES COMMANDS)
  restore(${var})
  # Each goes on a line of its own in the template: no blank line after it.
  string(REGEX REPLACE "\n$" "" ${var} "${${var}}")
endforeach()
file(READ "${TEMPLATE}" page)
string(CONFIGURE "${page}" page @ONLY)
file(WRITE "${OUT}" "${page}")
