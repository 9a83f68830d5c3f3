// The flags several subcommands share (cli/commands.h).
#include "cli/commands.h"

namespace ckptfs {
namespace {

// Flags of an s3:// root, named as mountpoint-s3 names them (docs/CLI.md).
void AddS3(CLI::App* cmd, Common& c) {
  cmd->add_option("--endpoint-url", c.s3.endpoint_url,
                  "S3 endpoint of an s3:// root (default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's, or AWS)");
  cmd->add_option("--region", c.s3.region, "S3 region (default: AWS_REGION, AWS_DEFAULT_REGION, the profile's, us-east-1)");
  cmd->add_flag("--no-sign-request", c.s3.no_sign_request, "Send unsigned requests (public buckets)");
  cmd->add_flag("--force-path-style", c.s3.force_path_style, "Address AWS buckets by path, not by host name");
  cmd->add_option("--max-threads", c.s3.max_threads, "Ranged GETs in flight per read (default 16)");
  cmd->add_option("--part-size", c.part_size, "Bytes per ranged GET (default 8MiB)");
  cmd->add_option("--request-timeout-s", c.s3.request_timeout_s,
                  "Seconds an S3 request may take, its retries included, before the read fails with EIO "
                  "(default 60; 1..3600)");
  cmd->add_option("--cache", c.cache_dir,
                  "Keep the bytes fetched from an s3:// root in this local directory (new, empty, or a ckptfs "
                  "cache; several mounts may share it) and read them from there next time; each 1 MiB block is "
                  "checked (CRC32C, ETag) before it is served");
  cmd->add_option("--max-cache-size", c.max_cache_size,
                  "Bound of the --cache directory; least recently used blocks are deleted first (default 10GiB; "
                  "units as --part-size, G = GiB)");
}

}  // namespace

void AddCommon(CLI::App* cmd, Common& c, bool view_flags) {
  cmd->add_option("--index", c.index, "Index location (default: under $CKPTFS_INDEX_DIR, else $XDG_CACHE_HOME/ckptfs, else ~/.cache/ckptfs, else /tmp/ckptfs-<uid>: <name>-<hash>)");
  AddS3(cmd, c);
  if (view_flags) {
    cmd->add_option("--max-file-size", c.max_file_size,
                    "Split consolidated/ into files of at most this many tensor bytes each (as HF's max_shard_size; each file's header comes on top) when the checkpoint has no file mapping (default 5GB; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; K, M, G, T are binary)");
    cmd->add_flag("--reindex", c.reindex, "Rebuild the index before opening");
    cmd->add_option("--names", c.names,
                    "JSON {fqn: name}: exactly which tensors consolidated/ and mesh/ hold, under which names "
                    "(replaces the model-weight rule)");
    cmd->add_option("--rules", c.rules,
                    "Mesh sharding rules (JSON {\"rules\": [{\"pattern\", \"kind\", \"dim\"}]}) placed before the preset's");
    cmd->add_option("--keep-dtype", c.keep_dtype,
                    "Dtype views (consolidated.bf16/, mesh/tp2.fp16/, ...) keep the tensors whose names match this "
                    "regex (ECMAScript, searched) as saved, e.g. 'e_score_correction_bias|router'");
  }
}

}  // namespace ckptfs
