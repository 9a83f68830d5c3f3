#include "source/s3_client.h"

#include <curl/curl.h>

#include "core/crc32c.h"
#include "core/digest.h"
#include "source/curl_api.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <random>
#include <thread>

namespace ckptfs {
namespace {

// SHA-256 of the empty body: GET, HEAD, DELETE.
constexpr char kEmptySha256[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
// A request that receives no byte (of headers or body) for this long is a
// stall: abandoned, and sent again on a new connection. Listings and HEADs
// get the long window: a server may take seconds to list a large prefix.
constexpr int64_t kStallMs = 15'000;
// A ranged GET's first window. A healthy S3 server sends a range's first
// byte within tens to hundreds of milliseconds and then streams, so 2 s of
// silence is a connection that went bad (a proxy holding an answer, a
// lost peer) far more often than a slow server. libcurl checks an idle
// transfer about once a second, so one stall costs 2-3 s and a read that
// meets one still ends within 5 s. Each further stall of the same GET
// doubles the window (2, 2, 4, 8, then 15 s), so a server that is merely
// slow to start its answers is still read, not failed in 8 quick tries.
constexpr int64_t kGetStallMs = 2'000;
// A body's payload hash is not computed (a second pass over gigabytes):
// its integrity is the checksum header the server verifies.
constexpr char kUnsignedPayload[] = "UNSIGNED-PAYLOAD";
constexpr long kConnectTimeoutMs = 5000;
// Error and listing bodies are kept up to this size (a page of 1000 keys
// is well under it).
constexpr size_t kMaxBody = 16 << 20;
constexpr int64_t kBackoffBaseMs = 100, kBackoffCapMs = 5000;
// The last attempt gets at least this long, whatever is left of the budget.
constexpr int64_t kMinAttemptMs = 1000;

// libcurl's functions (source/curl_api.h). Perform calls it only once
// LoadCurl has succeeded, so the pointer is never null here.
const CurlApi& Curl() { return *LoadCurl(); }

std::string Lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The text of the first <tag>...</tag> in `xml` from `from`, entities decoded.
std::string XmlDecode(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '&') {
      out += s[i];
      continue;
    }
    size_t semi = s.find(';', i);
    if (semi == std::string::npos) {
      out += s[i];
      continue;
    }
    const std::string ent = s.substr(i + 1, semi - i - 1);
    static const std::map<std::string, char> kNamed = {{"amp", '&'}, {"lt", '<'}, {"gt", '>'}, {"quot", '"'}, {"apos", '\''}};
    if (auto it = kNamed.find(ent); it != kNamed.end()) {
      out += it->second;
    } else if (ent.size() > 1 && ent[0] == '#') {
      unsigned long cp = ent[1] == 'x' ? std::strtoul(ent.c_str() + 2, nullptr, 16) : std::strtoul(ent.c_str() + 1, nullptr, 10);
      // UTF-8 of the code point.
      if (cp < 0x80) out += char(cp);
      else if (cp < 0x800) out += {char(0xC0 | (cp >> 6)), char(0x80 | (cp & 0x3F))};
      else if (cp < 0x10000) out += {char(0xE0 | (cp >> 12)), char(0x80 | ((cp >> 6) & 0x3F)), char(0x80 | (cp & 0x3F))};
      else out += {char(0xF0 | (cp >> 18)), char(0x80 | ((cp >> 12) & 0x3F)), char(0x80 | ((cp >> 6) & 0x3F)), char(0x80 | (cp & 0x3F))};
    } else {
      out += s.substr(i, semi - i + 1);
    }
    i = semi;
  }
  return out;
}

// The decoded text of every <tag>...</tag> in [from, to) of `xml`.
std::vector<std::string> XmlAll(const std::string& xml, const std::string& tag, size_t from = 0,
                                size_t to = std::string::npos) {
  std::vector<std::string> out;
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  to = std::min(to, xml.size());
  for (size_t at = xml.find(open, from); at != std::string::npos && at < to; at = xml.find(open, at)) {
    const size_t begin = at + open.size(), end = xml.find(close, begin);
    if (end == std::string::npos || end > to) break;
    out.push_back(XmlDecode(xml.substr(begin, end - begin)));
    at = end + close.size();
  }
  return out;
}

std::string XmlFirst(const std::string& xml, const std::string& tag, size_t from = 0, size_t to = std::string::npos) {
  auto all = XmlAll(xml, tag, from, to);
  return all.empty() ? "" : all[0];
}

// An ETag without its quotes and weak marker: servers differ in both.
std::string BareEtag(std::string e) {
  if (e.starts_with("W/")) e.erase(0, 2);
  std::erase(e, '"');
  return e;
}

int64_t ParseIsoTime(const std::string& s) {
  struct tm tm{};
  if (!strptime(s.c_str(), "%Y-%m-%dT%H:%M:%S", &tm)) return 0;
  return int64_t(timegm(&tm)) * 1'000'000'000;
}

int64_t ParseHttpTime(const std::string& s) {
  struct tm tm{};
  if (!strptime(s.c_str(), "%a, %d %b %Y %H:%M:%S", &tm)) return 0;
  return int64_t(timegm(&tm)) * 1'000'000'000;
}

}  // namespace

struct S3Client::Handle {
  CURL* curl = LoadCurl() ? Curl().easy_init() : nullptr;
  ~Handle() {
    if (curl) Curl().easy_cleanup(curl);
  }
};

struct S3Client::Request {
  bool head = false;
  std::string method;            // "" for GET or HEAD (head); else PUT, POST or DELETE
  const S3Body* body = nullptr;  // what a PUT or POST sends
  std::vector<std::string> headers;  // more "Name: value" lines
  bool completion = false;       // CompleteMultipartUpload: a 200 may carry an <Error>
  std::string key;    // full key ("" for the bucket)
  std::string query;  // sorted, encoded
  std::string if_match;
  bool ranged = false;
  uint64_t offset = 0, len = 0;
  char* dst = nullptr;  // ranged GETs write here
  bool listing = false;  // a ListObjectsV2 page: must end with its closing tag
  std::string What() const {
    if (!method.empty()) return method + " " + key + (query.empty() ? "" : "?" + query);
    if (key.empty()) return "listing";
    std::string w = std::string(head ? "HEAD " : "GET ") + key;
    if (ranged) w += " bytes [" + std::to_string(offset) + ", " + std::to_string(offset + len) + ")";
    return w;
  }
};

struct S3Client::Response {
  CURLcode curl = CURLE_OK;
  std::string curl_error;
  int64_t idle_ms = 0;     // since the last byte received, when it ended
  bool stalled = false;    // abandoned by OnProgress: no byte for the window
  bool sent = false;       // the request went out (else it failed connecting)
  long http = 0;
  std::string body;
  uint64_t received = 0;
  bool overflow = false;
  std::map<std::string, std::string> headers;  // lower-case names
  int attempts = 0;
  std::string last_retry_cause;
};

namespace {

using Clock = std::chrono::steady_clock;

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

struct Sink {
  const S3Client::Request* req;
  S3Client::Response* resp;
  int64_t stall_ms;
  Clock::time_point last_byte = Clock::now();  // of headers or body received, or of the body sent
  curl_off_t sent = 0;
};

// libcurl's progress callback, called as bytes arrive and about once a
// second while none do: ends the transfer once no byte came for the stall
// window. (CURLOPT_LOW_SPEED_TIME averages over a window of several
// seconds, so a stall in the middle of a body is seen seconds late.)
// Bytes sent count as progress too: an upload receives nothing until the
// server has taken its whole body.
int OnProgress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t ulnow) {
  auto* s = static_cast<Sink*>(user);
  if (ulnow != s->sent) s->sent = ulnow, s->last_byte = Clock::now();
  if (MsSince(s->last_byte) < s->stall_ms) return 0;
  s->resp->stalled = true;
  return 1;  // CURLE_ABORTED_BY_CALLBACK
}

// Feeds a body's spans to libcurl; rewound for a resend.
struct BodyReader {
  const S3Body* body;
  size_t span = 0;
  uint64_t at = 0;  // within spans[span]
};

size_t OnRead(char* out, size_t size, size_t n, void* user) {
  auto* r = static_cast<BodyReader*>(user);
  size_t done = 0;
  const size_t room = size * n;
  while (done < room && r->span < r->body->spans.size()) {
    const auto& [p, len] = r->body->spans[r->span];
    const size_t take = size_t(std::min<uint64_t>(room - done, len - r->at));
    std::memcpy(out + done, p + r->at, take);
    done += take;
    r->at += take;
    if (r->at == len) ++r->span, r->at = 0;
  }
  return done;
}

int OnSeek(void* user, curl_off_t offset, int origin) {
  auto* r = static_cast<BodyReader*>(user);
  if (origin != SEEK_SET || offset != 0) return CURL_SEEKFUNC_CANTSEEK;
  r->span = 0, r->at = 0;
  return CURL_SEEKFUNC_OK;
}

// The verb and body of a PUT, POST or DELETE.
void SetMethod(CURL* c, const S3Client::Request& r, BodyReader* reader) {
  const curl_off_t size = r.body ? curl_off_t(r.body->size()) : 0;
  if (r.method == "PUT") {
    Curl().easy_setopt(c, CURLOPT_UPLOAD, 1L);
    Curl().easy_setopt(c, CURLOPT_INFILESIZE_LARGE, size);
  } else if (r.method == "POST") {
    Curl().easy_setopt(c, CURLOPT_POST, 1L);
    Curl().easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, size);
  } else {
    Curl().easy_setopt(c, CURLOPT_CUSTOMREQUEST, r.method.c_str());
  }
  if (r.body) {
    Curl().easy_setopt(c, CURLOPT_READFUNCTION, OnRead);
    Curl().easy_setopt(c, CURLOPT_READDATA, reader);
    Curl().easy_setopt(c, CURLOPT_SEEKFUNCTION, OnSeek);
    Curl().easy_setopt(c, CURLOPT_SEEKDATA, reader);
    Curl().easy_setopt(c, CURLOPT_UPLOAD_BUFFERSIZE, 1L << 20);  // fewer callbacks per part
  }
  // SeaweedFS leaves a connection unusable after answering a PUT of an
  // empty body; such a request does not keep its connection.
  if (size == 0) Curl().easy_setopt(c, CURLOPT_FORBID_REUSE, 1L);
}

}  // namespace

S3Client::S3Client(S3Config config)
    : config_(std::move(config)), region_(config_.region), endpoint_(config_.endpoint) {}

std::pair<std::string, std::string> S3Client::RegionAndEndpoint() const {
  std::lock_guard<std::mutex> lock(where_mu_);
  return {region_, endpoint_};
}

bool S3Client::FollowRegion(const Response& resp) const {
  if (resp.curl != CURLE_OK || (resp.http != 301 && resp.http != 307 && resp.http != 400)) return false;
  auto it = resp.headers.find("x-amz-bucket-region");
  if (it == resp.headers.end() || it->second.empty()) return false;
  std::lock_guard<std::mutex> lock(where_mu_);
  if (it->second == region_) return false;
  region_ = it->second;
  // AWS's own endpoint names the region; another endpoint stays as given.
  if (config_.endpoint_is_aws) endpoint_ = "https://s3." + region_ + ".amazonaws.com";
  return true;
}

S3Client::~S3Client() = default;

std::unique_ptr<S3Client::Handle> S3Client::Borrow() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pool_.empty()) {
      auto h = std::move(pool_.back());
      pool_.pop_back();
      return h;
    }
  }
  return std::make_unique<Handle>();
}

void S3Client::Return(std::unique_ptr<Handle> h) const {
  std::lock_guard<std::mutex> lock(mu_);
  pool_.push_back(std::move(h));
}

static size_t OnBody(char* data, size_t size, size_t n, void* user) {
  auto* s = static_cast<Sink*>(user);
  const size_t bytes = size * n;
  s->last_byte = Clock::now();
  if (s->req->dst) {
    const uint64_t room = s->req->len > s->resp->received ? s->req->len - s->resp->received : 0;
    const bool ok_status = s->resp->http == 200 || s->resp->http == 206 || s->resp->http == 0;
    if (ok_status) {
      if (bytes > room) s->resp->overflow = true;
      std::memcpy(s->req->dst + s->resp->received, data, std::min<uint64_t>(bytes, room));
      s->resp->received += std::min<uint64_t>(bytes, room);
      return bytes;
    }
  }
  if (s->resp->body.size() < kMaxBody) s->resp->body.append(data, std::min(bytes, kMaxBody - s->resp->body.size()));
  return bytes;
}

static size_t OnHeader(char* data, size_t size, size_t n, void* user) {
  auto* s = static_cast<Sink*>(user);
  s->last_byte = Clock::now();
  std::string line(data, size * n);
  if (line.rfind("HTTP/", 0) == 0) {
    s->resp->headers.clear();
    const size_t sp = line.find(' ');
    if (sp != std::string::npos) s->resp->http = std::strtol(line.c_str() + sp + 1, nullptr, 10);
    return size * n;
  }
  const size_t colon = line.find(':');
  if (colon == std::string::npos) return size * n;
  std::string value = line.substr(colon + 1);
  while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' ')) value.pop_back();
  while (!value.empty() && value.front() == ' ') value.erase(value.begin());
  s->resp->headers[Lower(line.substr(0, colon))] = value;
  return size * n;
}

S3Client::Response S3Client::Perform(const Request& r, int64_t timeout_ms, int64_t stall_ms,
                                     bool fresh_connection) const {
  Response resp;
  auto h = Borrow();
  std::string why;
  if (!LoadCurl(&why) || !h->curl) {  // not retried (RetryCause), explained as it says
    resp.curl = CURLE_FAILED_INIT;
    resp.curl_error = why.empty() ? "curl_easy_init failed" : why;
    return resp;
  }
  CURL* c = h->curl;
  Curl().easy_reset(c);
  const auto [region, endpoint] = RegionAndEndpoint();
  const std::string url = S3Url(config_, endpoint, r.key, r.query);
  Curl().easy_setopt(c, CURLOPT_URL, url.c_str());
  Curl().easy_setopt(c, CURLOPT_NOSIGNAL, 1L);  // threads
  Curl().easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, kConnectTimeoutMs);
  // After a stall or a broken connection: not one of the kept-alive ones,
  // which may be going through the same bad path.
  if (fresh_connection) Curl().easy_setopt(c, CURLOPT_FRESH_CONNECT, 1L);
  // A server trickling bytes never trips the stall check: the whole
  // attempt ends with the retry budget.
  Curl().easy_setopt(c, CURLOPT_TIMEOUT_MS, long(timeout_ms));
  Curl().easy_setopt(c, CURLOPT_TCP_KEEPALIVE, 1L);
  if (!config_.ca_bundle.empty()) Curl().easy_setopt(c, CURLOPT_CAINFO, config_.ca_bundle.c_str());
  if (r.head) Curl().easy_setopt(c, CURLOPT_NOBODY, 1L);
  BodyReader reader{r.body};
  if (!r.method.empty()) SetMethod(c, r, &reader);
  struct curl_slist* headers = nullptr;
  headers = Curl().slist_append(headers, (std::string("x-amz-content-sha256: ") + (r.body ? kUnsignedPayload : kEmptySha256)).c_str());
  for (const std::string& h : r.headers) headers = Curl().slist_append(headers, h.c_str());
  if (config_.sign && !config_.credentials.session_token.empty())
    headers = Curl().slist_append(headers, ("x-amz-security-token: " + config_.credentials.session_token).c_str());
  if (!r.if_match.empty()) headers = Curl().slist_append(headers, ("If-Match: " + r.if_match).c_str());
  if (r.ranged)
    headers = Curl().slist_append(
        headers, ("Range: bytes=" + std::to_string(r.offset) + "-" + std::to_string(r.offset + r.len - 1)).c_str());
  Curl().easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  const std::string sigv4 = "aws:amz:" + region + ":s3";
  if (config_.sign) {
    Curl().easy_setopt(c, CURLOPT_AWS_SIGV4, sigv4.c_str());
    Curl().easy_setopt(c, CURLOPT_USERNAME, config_.credentials.access_key_id.c_str());
    Curl().easy_setopt(c, CURLOPT_PASSWORD, config_.credentials.secret_access_key.c_str());
  }
  Sink sink{&r, &resp, stall_ms};
  Curl().easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
  Curl().easy_setopt(c, CURLOPT_XFERINFOFUNCTION, OnProgress);
  Curl().easy_setopt(c, CURLOPT_XFERINFODATA, &sink);
  // Bodies into memory of ours: 256 KiB per receive instead of curl's 16 KiB
  // default, so a part costs a sixteenth of the callbacks and recv calls.
  if (r.dst) Curl().easy_setopt(c, CURLOPT_BUFFERSIZE, 256L << 10);
  Curl().easy_setopt(c, CURLOPT_WRITEFUNCTION, OnBody);
  Curl().easy_setopt(c, CURLOPT_WRITEDATA, &sink);
  Curl().easy_setopt(c, CURLOPT_HEADERFUNCTION, OnHeader);
  Curl().easy_setopt(c, CURLOPT_HEADERDATA, &sink);
  char err[CURL_ERROR_SIZE] = {0};
  Curl().easy_setopt(c, CURLOPT_ERRORBUFFER, err);
  resp.curl = Curl().easy_perform(c);
  resp.idle_ms = MsSince(sink.last_byte);
  if (resp.curl != CURLE_OK) resp.curl_error = err[0] ? err : Curl().easy_strerror(resp.curl);
  Curl().easy_getinfo(c, CURLINFO_RESPONSE_CODE, &resp.http);
  long request_bytes = 0;
  Curl().easy_getinfo(c, CURLINFO_REQUEST_SIZE, &request_bytes);
  resp.sent = request_bytes > 0;
  Curl().easy_setopt(c, CURLOPT_HTTPHEADER, nullptr);
  Curl().slist_free_all(headers);
  // The secret is not left in a pooled handle longer than the request.
  Curl().easy_setopt(c, CURLOPT_PASSWORD, "");
  // A handle whose connection broke is not reused: its state is unknown.
  if (resp.curl == CURLE_OK) Return(std::move(h));
  return resp;
}

namespace {

// What is wrong with the range a ranged GET was answered with, or "".
// A 206 must name the range asked (Content-Range: bytes FIRST-LAST/SIZE):
// one answered with another range of the same length would otherwise be
// served as the bytes asked for. A 200 is the whole object, right only for
// a range from byte 0 (its length is checked as the body's).
std::string WrongRange(const S3Client::Response& resp, const S3Client::Request& r) {
  const auto asked = [&] { return "bytes " + std::to_string(r.offset) + "-" + std::to_string(r.offset + r.len - 1); };
  if (resp.http == 200)
    return r.offset == 0 ? "" : "the whole object (HTTP 200, Range ignored) for " + asked();
  if (resp.http != 206) return "";
  const auto it = resp.headers.find("content-range");
  if (it == resp.headers.end()) return "HTTP 206 without Content-Range for " + asked();
  unsigned long long first = 0, last = 0;
  const bool parsed = std::sscanf(it->second.c_str(), "bytes %llu-%llu/", &first, &last) == 2;
  if (!parsed || first != r.offset || last != r.offset + r.len - 1)
    return "wrong range (the server sent Content-Range '" + it->second + "' for " + asked() + ")";
  return "";
}

// Why a response should be tried again, or "" when it should not.
std::string RetryCause(const S3Client::Response& resp, const S3Client::Request& r) {
  const bool ranged = r.ranged;
  const uint64_t want = r.len;
  const auto seconds = [](int64_t ms) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f s", double(ms) / 1000);
    return std::string(b);
  };
  switch (resp.curl) {
    case CURLE_OK: break;
    case CURLE_ABORTED_BY_CALLBACK:
      if (!resp.stalled) return "";
      return "stall (no byte for " + seconds(resp.idle_ms) + ", " +
             (resp.headers.empty() ? "no answer" : "answer started") + ")";
    case CURLE_OPERATION_TIMEDOUT:
      // Cut by the retry budget (or the connect timeout): a stall when the
      // connection had gone silent, else a server too slow to finish.
      if (resp.sent && resp.idle_ms >= 1000)
        return "stall (no byte for " + seconds(resp.idle_ms) + " when the retry budget ended)";
      return "timeout (" + resp.curl_error + ")";
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_PARTIAL_FILE:
    case CURLE_GOT_NOTHING:
    case CURLE_COULDNT_CONNECT:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SSL_CONNECT_ERROR: return "connection failed (" + resp.curl_error + ")";
    default: return "";
  }
  if (resp.curl != CURLE_OK) return "";
  if (resp.http >= 500 || resp.http == 429) {
    const std::string code = XmlFirst(resp.body, "Code");
    return "HTTP " + std::to_string(resp.http) + (code.empty() ? "" : " " + code);
  }
  // S3 may answer a completion 200 and then fail it in the body.
  if (r.completion && resp.http == 200 && resp.body.find("<Error>") != std::string::npos)
    return "HTTP 200 with error " + XmlFirst(resp.body, "Code");
  if (ranged && (resp.http == 206 || resp.http == 200) && resp.received != want && !resp.overflow)
    return "short body (" + std::to_string(resp.received) + " of " + std::to_string(want) + " bytes)";
  if (ranged && resp.received == want && !resp.overflow) {
    std::string wrong = WrongRange(resp, r);
    if (!wrong.empty()) return wrong;
  }
  // A page cut short but consistent with its Content-Length would
  // silently drop keys.
  if (r.listing && resp.http == 200 && resp.body.find("</ListBucketResult>") == std::string::npos)
    return "truncated listing (" + std::to_string(resp.body.size()) + " bytes, no closing tag)";
  return "";
}

}  // namespace

S3Client::Response S3Client::PerformWithRetries(const Request& r, int max_attempts, bool retry_connect) const {
  thread_local std::mt19937_64 rng(std::random_device{}());
  const auto start = std::chrono::steady_clock::now();
  std::string cause;
  bool followed = false;  // a region redirect, at most once per request
  int stalls = 0;         // of this request so far: each widens the next window
  bool fresh = false;     // the last attempt's connection failed or stalled
  for (int attempt = 1;; ++attempt) {
    const int64_t spent_before =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    const int64_t stall_ms =
        r.ranged ? std::min<int64_t>(kStallMs, kGetStallMs << std::max(0, stalls - 1)) : kStallMs;
    Response resp = Perform(r, std::max<int64_t>(config_.retry_budget_ms - spent_before, kMinAttemptMs), stall_ms, fresh);
    stalls += resp.stalled;
    fresh = resp.curl != CURLE_OK;
    if (!followed && FollowRegion(resp)) {  // sent again at once, signed for the bucket's region
      followed = true;
      --attempt;
      continue;
    }
    resp.attempts = attempt;
    resp.last_retry_cause = cause;
    cause = RetryCause(resp, r);
    const bool no_server = resp.curl == CURLE_COULDNT_CONNECT || resp.curl == CURLE_COULDNT_RESOLVE_HOST;
    if (cause.empty() || attempt >= max_attempts || (no_server && !retry_connect)) {
      resp.last_retry_cause = cause;
      return resp;
    }
    // Full jitter: a random wait up to an exponentially growing cap.
    const int64_t cap = std::min<int64_t>(kBackoffCapMs, kBackoffBaseMs << std::min(attempt - 1, 16));
    const int64_t wait = int64_t(rng() % uint64_t(cap + 1));
    const int64_t spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    if (spent + wait > config_.retry_budget_ms) {
      resp.last_retry_cause = cause;
      return resp;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(wait));
  }
}

std::string S3Client::Hint(int curl) const {
  switch (curl) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT: return "; is the endpoint right (" + config_.endpoint + ") and the server up?";
    case CURLE_PEER_FAILED_VERIFICATION:
      return "; the server's TLS certificate is not trusted: set AWS_CA_BUNDLE (or ca_bundle in the profile) to "
             "the PEM file of the CA that signed it";
    case CURLE_SSL_CACERT_BADFILE:
      return "; the CA bundle " + config_.ca_bundle + " cannot be read: set AWS_CA_BUNDLE to a PEM file";
    default: return "";
  }
}

Status S3Client::Explain(const Request& r, const Response& resp) const {
  const std::string where = r.key.empty() ? "listing " + config_.Root() : r.What() + " (s3://" + config_.location.bucket + ")";
  const std::string tries = resp.attempts > 1 ? " after " + std::to_string(resp.attempts) + " attempts" : "";
  const std::string hint = Hint(resp.curl);
  if (!resp.last_retry_cause.empty()) return Status::IOError(where + ": " + resp.last_retry_cause + tries + hint);
  if (resp.curl != CURLE_OK) return Status::IOError(where + ": " + resp.curl_error + tries + hint);
  const std::string code = XmlFirst(resp.body, "Code"), message = XmlFirst(resp.body, "Message");
  const std::string server = " (HTTP " + std::to_string(resp.http) + (code.empty() ? "" : " " + code) +
                             (message.empty() ? "" : ": " + message) + ")";
  if (resp.http == 403) {
    std::string what = code == "SignatureDoesNotMatch" ? "the secret key does not match the access key"
                       : code == "InvalidAccessKeyId"  ? "the access key is unknown to the server"
                                                       : "access denied";
    return Status::PermissionDenied(where + ": " + what + server + "; check the credentials (" +
                                    (config_.sign ? config_.credentials.source : "unsigned requests") +
                                    ") and that they may read the bucket");
  }
  if (resp.http == 404) {
    if (code == "NoSuchBucket")
      return Status::NotFound("bucket '" + config_.location.bucket + "' does not exist at " + config_.endpoint +
                              server + "; check the bucket name and --endpoint-url/--region");
    return Status::NotFound(where + ": no such object" + server);
  }
  if (resp.http == 412)
    return Status::Stale(where + ": changed since indexing (its ETag is no longer " + r.if_match +
                         "); run `ckptfs index` again");
  if (resp.http == 301 || resp.http == 307 || resp.http == 400) {
    // Followed once already (FollowRegion): the server still points elsewhere.
    auto it = resp.headers.find("x-amz-bucket-region");
    if (it != resp.headers.end())
      return Status::InvalidArgument(where + ": the server keeps redirecting to region " + it->second + server +
                                     "; pass --region " + it->second + " or set AWS_REGION");
  }
  if (r.ranged && resp.overflow)
    return Status::IOError(where + ": the server sent more bytes than the range asked (Range ignored?)" + server);
  return Status::IOError(where + ": unexpected answer" + server);
}

Result<S3ListPage> S3Client::List(const std::string& prefix) const {
  S3ListPage out;
  std::string token;
  // Bounded: 10^6 pages of 1000 keys is more than any checkpoint root.
  for (int page = 0; page < 1'000'000; ++page) {
    Request r;
    r.listing = true;
    // Sorted by name: the canonical query string of SigV4.
    r.query = (token.empty() ? "" : "continuation-token=" + S3Encode(token, false) + "&") +
              "delimiter=%2F&list-type=2&prefix=" + S3Encode(prefix, false);
    Response resp = PerformWithRetries(r, kMaxAttempts);
    if (resp.curl != CURLE_OK || resp.http != 200 || !resp.last_retry_cause.empty()) return Explain(r, resp);
    const std::string& xml = resp.body;
    for (size_t at = xml.find("<Contents>"); at != std::string::npos; at = xml.find("<Contents>", at + 1)) {
      const size_t end = xml.find("</Contents>", at);
      if (end == std::string::npos) break;
      S3ObjectInfo o;
      o.key = XmlFirst(xml, "Key", at, end);
      o.size = std::strtoull(XmlFirst(xml, "Size", at, end).c_str(), nullptr, 10);
      o.etag = XmlFirst(xml, "ETag", at, end);
      o.last_modified_ns = ParseIsoTime(XmlFirst(xml, "LastModified", at, end));
      out.objects.push_back(std::move(o));
    }
    for (size_t at = xml.find("<CommonPrefixes>"); at != std::string::npos; at = xml.find("<CommonPrefixes>", at + 1)) {
      const size_t end = xml.find("</CommonPrefixes>", at);
      if (end == std::string::npos) break;
      out.common_prefixes.push_back(XmlFirst(xml, "Prefix", at, end));
    }
    if (XmlFirst(xml, "IsTruncated") != "true") return out;
    token = XmlFirst(xml, "NextContinuationToken");
    if (token.empty()) return Status::IOError("listing s3://" + config_.location.bucket + "/" + prefix +
                                              ": truncated page without a continuation token");
  }
  return Status::IOError("listing s3://" + config_.location.bucket + "/" + prefix + ": too many pages");
}

Result<bool> S3Client::Probe(const std::string& prefix) const {
  Request r;
  r.listing = true;
  // No delimiter: the first key anywhere below the prefix, read next.
  r.query = "list-type=2&max-keys=1&prefix=" + S3Encode(prefix, false);
  // Answers of a server that is there are retried as always; no server
  // at all fails at once.
  Response resp = PerformWithRetries(r, kMaxAttempts, /*retry_connect=*/false);
  if (resp.curl != CURLE_OK || resp.http != 200 || !resp.last_retry_cause.empty()) return Explain(r, resp);
  // Credentials may list a bucket without reading it (S3's ListBucket
  // without GetObject): then every read would fail, so say so now.
  const std::string key = XmlFirst(resp.body, "Key");
  if (key.empty()) return false;
  RETURN_IF_ERROR(Head(key).status());
  return true;
}

Result<S3ObjectInfo> S3Client::Head(const std::string& key) const {
  Request r;
  r.head = true;
  r.key = key;
  Response resp = PerformWithRetries(r, kMaxAttempts);
  if (resp.curl != CURLE_OK || resp.http != 200) return Explain(r, resp);
  S3ObjectInfo o;
  o.key = key;
  o.size = std::strtoull(resp.headers["content-length"].c_str(), nullptr, 10);
  o.etag = resp.headers["etag"];
  if (o.etag.empty())  // reads are pinned by If-Match on it: without one, versions could mix
    return Status::NotSupported(r.What() + ": the server sent no ETag, so ckptfs cannot tell one version of the "
                                "object from the next; it reads only objects with an ETag (AWS S3, MinIO, "
                                "SeaweedFS, Ceph RGW send one; check proxies or gateways that strip it)");
  o.last_modified_ns = ParseHttpTime(resp.headers["last-modified"]);
  return o;
}

// A server that ignores If-Match still names the version it sent: bytes of
// another version than the indexed one are never served.
Status S3Client::CheckEtag(const Request& r, const Response& resp) const {
  auto it = resp.headers.find("etag");
  if (r.if_match.empty() || it == resp.headers.end() || BareEtag(it->second) == BareEtag(r.if_match))
    return Status::OK();
  return Status::Stale(r.What() + " (s3://" + config_.location.bucket + "): changed since indexing (the server sent "
                       "ETag " + it->second + ", not " + r.if_match + ", and ignored If-Match); run `ckptfs index` again");
}

Status S3Client::Get(const std::string& key, const std::string& etag, uint64_t offset, uint64_t len, char* dst) const {
  if (len == 0) return Status::OK();
  Request r;
  r.key = key;
  r.if_match = etag;
  r.ranged = true;
  r.offset = offset;
  r.len = len;
  r.dst = dst;
  Response resp = PerformWithRetries(r, kMaxAttempts);
  // A wrong range is RetryCause's to find (last_retry_cause); one more
  // byte than asked (overflow) is no cause to retry, but no answer either.
  if (resp.curl == CURLE_OK && (resp.http == 206 || resp.http == 200) && resp.received == len && !resp.overflow &&
      resp.last_retry_cause.empty()) {
    gets_.fetch_add(1, std::memory_order_relaxed);
    get_bytes_.fetch_add(len, std::memory_order_relaxed);
    return CheckEtag(r, resp);
  }
  if (resp.curl == CURLE_OK && resp.http == 416)
    return Status::Corruption(r.What() + ": unexpected end of object (HTTP 416)");
  // Reads are of objects listed or indexed at `etag`: one the server no
  // longer has was deleted since, as a local file would be.
  if (resp.curl == CURLE_OK && resp.http == 404 && XmlFirst(resp.body, "Code") != "NoSuchBucket")
    return Status::Stale(r.What() + " (s3://" + config_.location.bucket + "): gone since indexing (HTTP 404 " +
                         XmlFirst(resp.body, "Code") + "); run `ckptfs index` again");
  return Explain(r, resp);
}

std::string S3Client::Stats::Describe() const {
  char gb[32];
  std::snprintf(gb, sizeof gb, "%.2f", double(bytes) / 1e9);
  return "s3: " + std::to_string(gets) + " ranged GETs, " + gb + " GB received";
}

// --- Uploads -----------------------------------------------------------------

namespace {

// A request with a verb.
S3Client::Request Upload(const std::string& method, const std::string& key, const std::string& query,
                         const S3Body* body) {
  S3Client::Request r;
  r.method = method;
  r.key = key;
  r.query = query;
  r.body = body;
  return r;
}

bool Answered(const S3Client::Response& resp, long http) {
  return resp.curl == CURLE_OK && resp.http == http && resp.last_retry_cause.empty();
}

}  // namespace

Result<std::pair<std::string, S3PartCheck>> S3Client::CreateMultipartUpload(const std::string& key,
                                                                             bool ask_crc32c) const {
  Request r = Upload("POST", key, "uploads=", nullptr);
  if (ask_crc32c) r.headers.push_back("x-amz-checksum-algorithm: CRC32C");
  Response resp = PerformWithRetries(r, kMaxAttempts);
  if (!Answered(resp, 200)) return Explain(r, resp);
  const std::string id = XmlFirst(resp.body, "UploadId");
  if (id.empty()) return Status::IOError(r.What() + " (s3://" + config_.location.bucket + "): no UploadId in the answer");
  // A server that takes CRC32C part checksums says so; one that ignores
  // the header gets Content-MD5 instead.
  const auto it = resp.headers.find("x-amz-checksum-algorithm");
  const bool crc = ask_crc32c && ((it != resp.headers.end() && Lower(it->second) == "crc32c") ||
                                  Lower(XmlFirst(resp.body, "ChecksumAlgorithm")) == "crc32c");
  return std::make_pair(id, crc ? S3PartCheck::kCrc32c : S3PartCheck::kMd5);
}

Result<std::string> S3Client::UploadPart(const std::string& key, const std::string& upload_id, int number,
                                         const S3Body& body, S3PartCheck check, uint32_t crc32c,
                                         const std::string& md5_base64) const {
  // Sorted by name: the canonical query string of SigV4.
  Request r = Upload("PUT", key, "partNumber=" + std::to_string(number) + "&uploadId=" + S3Encode(upload_id, false), &body);
  if (check == S3PartCheck::kCrc32c) r.headers.push_back("x-amz-checksum-crc32c: " + Crc32cBase64(crc32c));
  else r.headers.push_back("Content-MD5: " + md5_base64);
  Response resp = PerformWithRetries(r, kMaxAttempts);
  if (!Answered(resp, 200)) return Explain(r, resp);
  std::string etag = resp.headers["etag"];
  if (etag.empty()) return Status::IOError(r.What() + " (s3://" + config_.location.bucket + "): no ETag in the answer");
  if (check == S3PartCheck::kCrc32c) {
    // A server that echoes the checksum checked it; one that echoes another
    // value saw other bytes.
    auto it = resp.headers.find("x-amz-checksum-crc32c");
    if (it != resp.headers.end() && it->second != Crc32cBase64(crc32c))
      return Status::IOError(r.What() + ": the server stored CRC32C " + it->second + ", not the " +
                             Crc32cBase64(crc32c) + " sent");
  }
  return etag;
}

Status S3Client::CompleteMultipartUpload(const std::string& key, const std::string& upload_id,
                                         const std::vector<S3CompletedPart>& parts, S3PartCheck check) const {
  const std::string xml = S3CompletionXml(parts, check);
  S3Body body{{{xml.data(), xml.size()}}};
  Request r = Upload("POST", key, "uploadId=" + S3Encode(upload_id, false), &body);
  r.completion = true;
  r.headers.push_back("Content-Type: application/xml");
  Response resp = PerformWithRetries(r, kMaxAttempts);
  if (Answered(resp, 200)) return Status::OK();
  // Retried after the server completed it (the answer was lost): the
  // upload is gone and the object is there, of as many parts.
  if (resp.attempts > 1 && resp.curl == CURLE_OK && resp.http == 404 && XmlFirst(resp.body, "Code") == "NoSuchUpload") {
    auto head = Head(key);
    if (head.ok() && BareEtag(head->etag).ends_with("-" + std::to_string(parts.size()))) return Status::OK();
  }
  return Explain(r, resp);
}

Status S3Client::AbortMultipartUpload(const std::string& key, const std::string& upload_id) const {
  Request r = Upload("DELETE", key, "uploadId=" + S3Encode(upload_id, false), nullptr);
  Response resp = PerformWithRetries(r, kMaxAttempts);
  if (Answered(resp, 204) || Answered(resp, 200) || (resp.curl == CURLE_OK && resp.http == 404)) return Status::OK();
  return Explain(r, resp);
}

Result<std::vector<S3MultipartUploadInfo>> S3Client::ListMultipartUploads(const std::string& prefix) const {
  std::vector<S3MultipartUploadInfo> out;
  std::string key_marker, id_marker;
  for (int page = 0; page < 1'000'000; ++page) {
    std::string q;
    if (!key_marker.empty()) q += "key-marker=" + S3Encode(key_marker, false) + "&";
    q += "prefix=" + S3Encode(prefix, false) + "&";
    if (!id_marker.empty()) q += "upload-id-marker=" + S3Encode(id_marker, false) + "&";
    Request r = Upload("GET", "", q + "uploads=", nullptr);
    Response resp = PerformWithRetries(r, kMaxAttempts);
    if (!Answered(resp, 200)) return Explain(r, resp);
    const std::string& xml = resp.body;
    for (size_t at = xml.find("<Upload>"); at != std::string::npos; at = xml.find("<Upload>", at + 1)) {
      const size_t end = xml.find("</Upload>", at);
      if (end == std::string::npos) break;
      out.push_back({XmlFirst(xml, "Key", at, end), XmlFirst(xml, "UploadId", at, end)});
    }
    if (XmlFirst(xml, "IsTruncated") != "true") return out;
    key_marker = XmlFirst(xml, "NextKeyMarker");
    id_marker = XmlFirst(xml, "NextUploadIdMarker");
    if (key_marker.empty() && id_marker.empty())
      return Status::IOError("listing uploads under s3://" + config_.location.bucket + "/" + prefix +
                             ": truncated page without a marker");
  }
  return Status::IOError("listing uploads under s3://" + config_.location.bucket + "/" + prefix + ": too many pages");
}

Status S3Client::Put(const std::string& key, const S3Body& body) const {
  Request r = Upload("PUT", key, "", &body);
  Md5 md5;
  uint32_t crc = 0;
  for (const auto& [p, len] : body.spans) {
    md5.Update(p, len);
    crc = Crc32c(crc, p, len);
  }
  const auto digest = md5.Final();
  r.headers.push_back("Content-MD5: " + Base64(digest.data(), digest.size()));
  r.headers.push_back("x-amz-checksum-crc32c: " + Crc32cBase64(crc));
  Response resp = PerformWithRetries(r, kMaxAttempts);
  if (Answered(resp, 200)) return Status::OK();
  return Explain(r, resp);
}

Status S3Client::Delete(const std::string& key) const {
  Request r = Upload("DELETE", key, "", nullptr);
  Response resp = PerformWithRetries(r, kMaxAttempts);
  if (Answered(resp, 204) || Answered(resp, 200) || (resp.curl == CURLE_OK && resp.http == 404)) return Status::OK();
  return Explain(r, resp);
}

}  // namespace ckptfs
