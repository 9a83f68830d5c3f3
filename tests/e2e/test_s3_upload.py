"""The S3 calls the writer uploads with (source/s3_client.h, through
``ckptfs._writer.S3Client``), against a real SeaweedFS that checks every
signature and every part's checksum; what landed is read back with boto3.
Through the fault proxy: 503 SlowDown and connection resets are retried
(a completion whose answer was lost included), a fault that never clears
fails within the retry budget, naming the cause."""

from __future__ import annotations

import os
import time

import pytest
from botocore.exceptions import ClientError

from s3_server import BUCKET

MiB = 1 << 20


def _client(endpoint: str, prefix: str = "up"):
    from ckptfs import _writer
    return _writer.S3Client(f"s3://{BUCKET}/{prefix}", endpoint_url=endpoint)


def _open_uploads(boto, prefix: str) -> list[tuple[str, str]]:
    listed = boto.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)
    return [(u["Key"], u["UploadId"]) for u in listed.get("Uploads", [])]


def _upload(c, key: str, parts: list[bytes]) -> None:
    upload_id, check = c.create_multipart_upload(key)
    done = []
    for n, data in enumerate(parts, start=1):
        done.append((n, c.upload_part(key, upload_id, n, data, check), _crc32c(data)))
    c.complete_multipart_upload(key, upload_id, done, check)


def _crc32c(data: bytes) -> int:
    from ckptfs import _writer
    return _writer.crc32c(data)


def test_a_multipart_upload_lands_whole_with_crc32c_part_checks(s3_env):
    boto = s3_env["client"]
    c = _client(s3_env["endpoint"])
    parts = [os.urandom(5 * MiB), os.urandom(5 * MiB + 3), os.urandom(1234)]
    upload_id, check = c.create_multipart_upload("up/whole")
    assert check == "crc32c"  # SeaweedFS names the algorithm back
    assert ("up/whole", upload_id) in _open_uploads(boto, "up/")
    etags = [c.upload_part("up/whole", upload_id, n, p, check) for n, p in enumerate(parts, start=1)]
    with pytest.raises(ClientError):  # nothing visible before the completion
        boto.head_object(Bucket=BUCKET, Key="up/whole")
    c.complete_multipart_upload("up/whole", upload_id,
                                [(n, e, _crc32c(p)) for n, (e, p) in enumerate(zip(etags, parts), start=1)], check)
    assert boto.get_object(Bucket=BUCKET, Key="up/whole")["Body"].read() == b"".join(parts)
    assert _open_uploads(boto, "up/") == []


def test_parts_checked_by_content_md5_where_a_server_takes_no_crc32c(s3_env):
    boto = s3_env["client"]
    c = _client(s3_env["endpoint"])
    parts = [os.urandom(5 * MiB), os.urandom(77)]
    # Asked for no checksum algorithm, the server names none back: parts
    # go with Content-MD5 (what a server without CRC32C support gets).
    upload_id, check = c.create_multipart_upload("up/md5", ask_crc32c=False)
    assert check == "md5"
    etags = [c.upload_part("up/md5", upload_id, n, p, "md5") for n, p in enumerate(parts, start=1)]
    c.complete_multipart_upload("up/md5", upload_id, [(n, e, 0) for n, e in enumerate(etags, start=1)], "md5")
    assert boto.get_object(Bucket=BUCKET, Key="up/md5")["Body"].read() == b"".join(parts)


def test_an_aborted_upload_leaves_nothing(s3_env):
    boto = s3_env["client"]
    c = _client(s3_env["endpoint"])
    upload_id, check = c.create_multipart_upload("up/aborted")
    c.upload_part("up/aborted", upload_id, 1, os.urandom(5 * MiB), check)
    assert [u for u in c.list_multipart_uploads("up/") if u[0] == "up/aborted"] == [("up/aborted", upload_id)]
    c.abort_multipart_upload("up/aborted", upload_id)
    assert [u for u in _open_uploads(boto, "up/") if u[0] == "up/aborted"] == []
    assert [u for u in c.list_multipart_uploads("up/") if u[0] == "up/aborted"] == []
    with pytest.raises(ClientError):
        boto.head_object(Bucket=BUCKET, Key="up/aborted")
    c.abort_multipart_upload("up/aborted", upload_id)  # already gone: not an error


def test_put_and_delete(s3_env):
    boto = s3_env["client"]
    c = _client(s3_env["endpoint"])
    body = os.urandom(100_000)
    c.put("up/small", body)
    assert boto.get_object(Bucket=BUCKET, Key="up/small")["Body"].read() == body
    c.delete("up/small")
    with pytest.raises(ClientError):
        boto.head_object(Bucket=BUCKET, Key="up/small")
    c.delete("up/small")  # not there: not an error


def test_slowdown_and_resets_are_retried_the_completion_included(s3_env):
    from s3_fault_proxy import FaultProxy
    boto = s3_env["client"]
    parts = [os.urandom(5 * MiB), os.urandom(4096)]
    # Each kind of request is faulted once or twice: the creation, a part
    # (its connection dropped, then SlowDown), the completion (its answer
    # reset after the server completed it: the retry finds the upload gone
    # and the object whole), and a small PutObject.
    proxy = FaultProxy(s3_env["port"], seed=7, p_slowdown=0, p_reset=0, p_truncate=0, script={
        "?uploads=": ["slowdown"], "partNumber=1&": ["drop", "slowdown"], "POST /ckpts/up/retried?uploadId=": ["reset"],
        "PUT /ckpts/up/retried-small ": ["drop"]})
    try:
        c = _client(f"http://127.0.0.1:{proxy.port}")
        _upload(c, "up/retried", parts)
        c.put("up/retried-small", b"metadata" * 100)
        counts = dict(proxy.counts)
    finally:
        proxy.close()
    assert (counts["slowdown"], counts["drop"], counts["reset"]) == (2, 2, 1), counts
    assert boto.get_object(Bucket=BUCKET, Key="up/retried")["Body"].read() == b"".join(parts)
    assert boto.get_object(Bucket=BUCKET, Key="up/retried-small")["Body"].read() == b"metadata" * 100
    assert [u for u in _open_uploads(boto, "up/") if u[0] == "up/retried"] == []


def test_a_fault_that_never_clears_fails_in_bounded_time_with_its_cause(s3_env):
    from s3_fault_proxy import FaultProxy
    c_direct = _client(s3_env["endpoint"])
    upload_id, check = c_direct.create_multipart_upload("up/doomed")
    proxy = FaultProxy(s3_env["port"], seed=9, p_slowdown=1.0, p_reset=0, p_truncate=0)
    try:
        c = _client(f"http://127.0.0.1:{proxy.port}")
        t0 = time.monotonic()
        with pytest.raises(OSError, match=r"partNumber=1.*HTTP 503 SlowDown after 8 attempts"):
            c.upload_part("up/doomed", upload_id, 1, os.urandom(MiB), check)
        assert time.monotonic() - t0 < 65  # the retry budget, 60 s, and the last attempt
    finally:
        proxy.close()
    c_direct.abort_multipart_upload("up/doomed", upload_id)
    assert [u for u in _open_uploads(s3_env["client"], "up/") if u[0] == "up/doomed"] == []
