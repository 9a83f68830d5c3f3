#include "source/curl_api.h"

#include <dlfcn.h>

namespace ckptfs {
namespace {

// The soname of the libcurl ckptfs was built against (CMakeLists.txt):
// libcurl.so.4, or libcurl-gnutls.so.4 for Debian's GnuTLS flavour.
constexpr char kLibcurl[] = CKPTFS_LIBCURL;
constexpr char kInstall[] =
    "; s3:// roots need libcurl 7.75 or newer: install it (Debian, Ubuntu: apt install libcurl4; "
    "Fedora: dnf install libcurl)";

struct Loaded {
  CurlApi api{};
  bool ok = false;
  std::string why;
};

template <typename F>
bool Resolve(void* lib, const char* name, F* f, std::string* why) {
  *f = reinterpret_cast<F>(::dlsym(lib, name));
  if (!*f) *why = std::string(kLibcurl) + " has no " + name;
  return *f != nullptr;
}

Loaded Load() {
  Loaded l;
  // RTLD_LOCAL: its symbols stay out of the process's namespace.
  void* lib = ::dlopen(kLibcurl, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = ::dlerror();
    l.why = std::string("cannot load ") + kLibcurl + " (" + (e ? e : "dlopen failed") + ")" + kInstall;
    return l;
  }
  decltype(&::curl_version_info) version_info = nullptr;
  decltype(&::curl_global_init) global_init = nullptr;
  CurlApi& a = l.api;
  if (!Resolve(lib, "curl_version_info", &version_info, &l.why) ||
      !Resolve(lib, "curl_global_init", &global_init, &l.why) ||
      !Resolve(lib, "curl_easy_init", &a.easy_init, &l.why) ||
      !Resolve(lib, "curl_easy_cleanup", &a.easy_cleanup, &l.why) ||
      !Resolve(lib, "curl_easy_reset", &a.easy_reset, &l.why) ||
      !Resolve(lib, "curl_easy_setopt", &a.easy_setopt, &l.why) ||
      !Resolve(lib, "curl_easy_perform", &a.easy_perform, &l.why) ||
      !Resolve(lib, "curl_easy_getinfo", &a.easy_getinfo, &l.why) ||
      !Resolve(lib, "curl_easy_strerror", &a.easy_strerror, &l.why) ||
      !Resolve(lib, "curl_slist_append", &a.slist_append, &l.why) ||
      !Resolve(lib, "curl_slist_free_all", &a.slist_free_all, &l.why)) {
    l.why += kInstall;
    return l;
  }
  const curl_version_info_data* v = version_info(CURLVERSION_NOW);
  if (!v || v->version_num < kMinCurlVersion) {
    l.why = std::string(kLibcurl) + " is libcurl " + (v && v->version ? v->version : "of an unknown version") +
            ", too old to sign requests" + kInstall;
    return l;
  }
  if (const CURLcode rc = global_init(CURL_GLOBAL_DEFAULT); rc != CURLE_OK) {
    l.why = "curl_global_init failed (" + std::string(a.easy_strerror(rc)) + ")";
    return l;
  }
  // Never closed: libcurl keeps global state until the process ends.
  l.ok = true;
  return l;
}

}  // namespace

const CurlApi* LoadCurl(std::string* why) {
  static const Loaded loaded = Load();  // thread-safe, once
  if (!loaded.ok && why) *why = loaded.why;
  return loaded.ok ? &loaded.api : nullptr;
}

}  // namespace ckptfs
