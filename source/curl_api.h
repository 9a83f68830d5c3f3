// libcurl, opened when the first S3 request is made rather than when ckptfs
// starts. Linking it would load it, and the ~28 libraries it needs (TLS,
// HTTP/2, Kerberos, LDAP, IDN), into every process: a mount of local files,
// `ckptfs index`, `ckptfs --version`. From a cold page cache that was most
// of a local mount's start (docs/BENCHMARKS.md, "libcurl loaded on first
// use"). Only source/s3_client.cc calls it.
#pragma once

#include <curl/curl.h>

#include <string>

namespace ckptfs {

// The libcurl functions ckptfs calls, resolved from the loaded library.
struct CurlApi {
  decltype(&::curl_easy_init) easy_init;
  decltype(&::curl_easy_cleanup) easy_cleanup;
  decltype(&::curl_easy_reset) easy_reset;
  decltype(&::curl_easy_setopt) easy_setopt;
  decltype(&::curl_easy_perform) easy_perform;
  decltype(&::curl_easy_getinfo) easy_getinfo;
  decltype(&::curl_easy_strerror) easy_strerror;
  decltype(&::curl_slist_append) slist_append;
  decltype(&::curl_slist_free_all) slist_free_all;
};

// The oldest libcurl that signs requests (CURLOPT_AWS_SIGV4): 7.75.0.
constexpr unsigned kMinCurlVersion = 0x074b00;

// libcurl (libcurl.so.4), loaded, checked (kMinCurlVersion) and
// initialised (curl_global_init) on the first call, from any thread; the
// same answer after. Null when it cannot be: then `why`, when given, says
// why and what to install.
const CurlApi* LoadCurl(std::string* why = nullptr);

}  // namespace ckptfs
