#include "cli/daemon.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ckptfs {
namespace {

// The child's side: detach from the terminal, then report 0 on `fd`.
void Detach(int fd) {
  ::setsid();
  if (::chdir("/") != 0) std::perror("ckptfs: chdir /");
  if (int null = ::open("/dev/null", O_RDWR); null >= 0) {
    ::dup2(null, 0);
    ::dup2(null, 1);
    ::dup2(null, 2);
    if (null > 2) ::close(null);
  }
  unsigned char ok = 0;
  (void)!::write(fd, &ok, 1);
  ::close(fd);
}

// The parent's side: the child's one-byte word, or its exit status when it
// ended without one.
int WaitForWord(int fd, pid_t child) {
  unsigned char word;
  ssize_t n;
  do n = ::read(fd, &word, 1);
  while (n < 0 && errno == EINTR);
  ::close(fd);
  if (n == 1) return word;
  int status = 0;
  if (::waitpid(child, &status, 0) == child && WIFEXITED(status)) return WEXITSTATUS(status);
  std::fprintf(stderr, "ckptfs: error: the mount process died (%s) before the mount was up\n",
               WIFSIGNALED(status) ? strsignal(WTERMSIG(status)) : "no status");
  return 7;  // kExitMountFailed
}

}  // namespace

int RunInBackground(const std::function<int(std::function<void()> detach)>& body) {
  std::fflush(nullptr);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    std::perror("ckptfs: pipe");
    return 7;
  }
  pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("ckptfs: fork");
    return 7;
  }
  if (pid > 0) {
    ::close(fds[1]);
    return WaitForWord(fds[0], pid);
  }
  ::close(fds[0]);
  int word_fd = fds[1];
  int rc = body([&word_fd] {
    Detach(word_fd);
    word_fd = -1;
  });
  if (word_fd >= 0) {  // never detached: the parent exits with our status
    unsigned char code = static_cast<unsigned char>(rc);
    (void)!::write(word_fd, &code, 1);
  }
  std::fflush(nullptr);
  std::_Exit(rc);
}

}  // namespace ckptfs
