"""Access through an `--allow-other` mount, and symlinks in the source root.

An unprivileged user (created here with useradd, removed afterwards) reads
through mounts made by root:

- a virtual file gets at most the permissions every source it is built from
  grants: one root-owned 0600 shard makes the checkpoint's consolidated/ and
  tensors/ files unreadable to the user, exactly like the shard itself;
  with every shard 0644 the user reads the right bytes;
- symlinks are shown as symlinks and never followed by the daemon: a link to
  /etc/shadow or /etc stays a link (the kernel resolves it outside the
  mount, with the user's own rights), and a shard linked from outside the
  root is not used by any view.

Everything lives in a 0755 directory under /tmp so the user can reach the
mount point (pytest's own tmp dirs are private to root).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile

import pytest

import harness
import np_ckpt
from _util import read_pages, run_ckptfs

USER = "ckptfs-e2e"

# strerror text (LC_ALL=C) -> errno name, to read sha256sum's messages
ERRNO_BY_TEXT = {os.strerror(code): name for code, name in errno.errorcode.items()}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def user():
    """(uid, gid) of a fresh system user without a home; removed afterwards."""
    subprocess.run(["userdel", USER], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group",
                    "--shell", "/usr/sbin/nologin", USER], check=True)
    try:
        pw = pwd.getpwnam(USER)
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", USER], check=True)


def as_user(user, paths: list[str]) -> dict[str, dict]:
    """Reads each path whole as ``user`` with coreutils' sha256sum (any
    Python here may sit in a directory the user cannot enter):
    {path: {"sha": ...} or {"err": "EACCES"}}."""
    uid, gid = user
    p = subprocess.run(["sha256sum", "--", *paths], user=uid, group=gid, extra_groups=[],
                       capture_output=True, text=True, cwd="/", timeout=60,
                       env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"})
    out = {}
    for line in p.stdout.splitlines():
        digest, path = line.split("  ", 1)
        out[path] = {"sha": digest}
    for line in p.stderr.splitlines():
        prefix, path, text = line.split(": ", 2)
        assert prefix == "sha256sum" and text in ERRNO_BY_TEXT, line
        out[path] = {"err": ERRNO_BY_TEXT[text]}
    assert sorted(out) == sorted(paths), (p.stdout, p.stderr)
    return out


@pytest.fixture(scope="module")
def public_base():
    """A 0755 directory under /tmp, removed afterwards."""
    base = tempfile.mkdtemp(prefix="ckptfs-access-", dir="/tmp")
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _public_mount(base: str, root: str, name: str) -> harness.Mounted:
    mnt = os.path.join(base, name)
    os.mkdir(mnt)
    os.chmod(mnt, 0o755)
    return harness.Mounted(root, "--allow-other", mnt=mnt, log_file=mnt + ".log")


# ---------------------------------------------------------------------------
# permissions
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def access_tree(public_base, user):
    """src/open (3 shards, 0644) and src/closed (the same, shard 2 0600),
    mounted with --allow-other."""
    src = os.path.join(public_base, "src")
    os.mkdir(src)
    os.chmod(src, 0o755)
    both = {name: np_ckpt.write(os.path.join(src, name), world_size=3,
                                specs=np_ckpt.ROW_SPECS, seed=21)
            for name in ("open", "closed")}
    os.chmod(both["closed"].shard(1), 0o600)
    with _public_mount(public_base, src, "access-mnt") as m:
        yield m, both


def _ckpt_files(m, name: str, synth) -> list[str]:
    return [m.p(name, rel) for rel in np_ckpt.virtual_files(synth)]


def test_mount_has_default_permissions(access_tree):
    m, _ = access_tree
    with open("/proc/self/mounts") as f:
        opts = [line.split()[3].split(",") for line in f
                if line.split()[1] == os.path.realpath(m.path)]
    assert len(opts) == 1, opts
    assert "default_permissions" in opts[0] and "allow_other" in opts[0], opts[0]


def test_user_reads_open_checkpoint(access_tree, user):
    """Every shard 0644: the user reads the sources and the virtual files,
    with the bytes root reads (themselves checked against the tensors)."""
    m, both = access_tree
    synth = both["open"]
    virtual = _ckpt_files(m, "open", synth)
    for rel, p in zip(np_ckpt.virtual_files(synth), virtual):
        np_ckpt.check_virtual(rel, read(p), synth)
    shards = [m.p("open", np_ckpt.shard_name(r)) for r in range(3)]
    got = as_user(user, virtual + shards)
    want = {p: {"sha": sha(read(p))} for p in virtual}
    want.update({m.p("open", np_ckpt.shard_name(r)): {"sha": sha(read(synth.shard(r)))}
                 for r in range(3)})
    assert got == want


def test_user_denied_what_a_0600_source_feeds(access_tree, user):
    """Shard 2 of `closed` is root's 0600: the user gets EACCES on it through
    the mount, and on every consolidated/ and tensors/ file built from it;
    the other shards (0644) stay readable. Root still reads everything."""
    m, both = access_tree
    synth = both["closed"]
    virtual = _ckpt_files(m, "closed", synth)
    shards = [m.p("closed", np_ckpt.shard_name(r)) for r in range(3)]
    got = as_user(user, virtual + shards)
    assert got[shards[1]] == {"err": "EACCES"}, got[shards[1]]
    for r in (0, 2):
        assert got[shards[r]] == {"sha": sha(read(synth.shard(r)))}, got[shards[r]]
    leaked = {p: v for p, v in got.items() if p in virtual and v != {"err": "EACCES"}}
    assert not leaked, f"virtual files built from a 0600 shard, read by another user: {leaked}"
    for rel, p in zip(np_ckpt.virtual_files(synth), virtual):
        np_ckpt.check_virtual(rel, read(p), synth)


def test_virtual_modes_within_sources(access_tree):
    """A virtual file's mode grants nothing a source withholds: with a 0600
    shard among its sources, no group or other bits; with all 0644, read
    for everyone. No write or execute bits either way."""
    m, both = access_tree
    for name, others in (("closed", 0), ("open", 0o044)):
        for p in _ckpt_files(m, name, both[name]):
            st = os.stat(p)
            assert stat.S_ISREG(st.st_mode), p
            assert st.st_mode & 0o077 == others, f"{p}: mode {oct(st.st_mode)}"
            assert st.st_mode & 0o333 == 0, f"{p}: mode {oct(st.st_mode)}"


# ---------------------------------------------------------------------------
# symlinks
# ---------------------------------------------------------------------------

LINKS = {"leak.txt": "/etc/shadow", "etcdir": "/etc", "latest": "step_200",
         "zz_latest": "step_200"}
OUTSIDE_RANK = 1  # a middle rank: without it the tensors have holes, not smaller shapes


@pytest.fixture(scope="module")
def link_tree(public_base):
    """src-links/ with step_200 (a checkpoint), the LINKS, and ext (a
    checkpoint whose shard 2 is a symlink to a file outside the root)."""
    src = os.path.join(public_base, "src-links")
    os.mkdir(src)
    os.chmod(src, 0o755)
    step = np_ckpt.write(os.path.join(src, "step_200"), world_size=3,
                         specs=np_ckpt.ROW_SPECS, seed=31)
    for name, target in LINKS.items():
        os.symlink(target, os.path.join(src, name))
    ext = np_ckpt.write(os.path.join(src, "ext"), world_size=3, specs=np_ckpt.ROW_SPECS,
                        seed=32)
    outside = os.path.join(public_base, "outside")
    os.mkdir(outside)
    moved = os.path.join(outside, np_ckpt.shard_name(OUTSIDE_RANK))
    shutil.move(ext.shard(OUTSIDE_RANK), moved)
    os.symlink(moved, ext.shard(OUTSIDE_RANK))
    with _public_mount(public_base, src, "links-mnt") as m:
        yield m, src, step, ext


def test_symlinks_shown_as_symlinks(link_tree):
    m, _, _, ext = link_tree
    links = dict(LINKS)
    links[os.path.join("ext", np_ckpt.shard_name(OUTSIDE_RANK))] = os.readlink(
        ext.shard(OUTSIDE_RANK))
    for name, target in links.items():
        st = os.lstat(m.p(name))
        assert stat.S_ISLNK(st.st_mode), f"{name}: lstat mode {oct(st.st_mode)}, not a link"
        assert os.readlink(m.p(name)) == target
    kinds = {e.name: e.is_symlink() for e in os.scandir(m.path)}
    assert all(kinds[n] for n in LINKS), f"readdir types: {kinds}"


def test_link_to_shadow_not_served(link_tree, user):
    """The user cannot read /etc/shadow through leak.txt or etcdir/shadow
    (the kernel follows the links to the real file, 0640 root:shadow), and
    `ckptfs cat` of the link does not print the target's bytes."""
    m, src, _, _ = link_tree
    got = as_user(user, [m.p("leak.txt"), m.p("etcdir", "shadow")])
    assert got == {m.p("leak.txt"): {"err": "EACCES"},
                   m.p("etcdir", "shadow"): {"err": "EACCES"}}, got
    shadow = read("/etc/shadow")
    r = run_ckptfs("cat", src, "leak.txt")
    assert shadow not in r.stdout, "ckptfs cat served /etc/shadow through leak.txt"


def test_link_to_etc_not_listed_by_daemon(link_tree):
    """`ckptfs ls ROOT etcdir` (the daemon's own tree, no kernel involved)
    does not list /etc's entries."""
    m, src, _, _ = link_tree
    r = run_ckptfs("ls", src, "etcdir", "--json")
    listed = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else []
    names = {e["name"] for e in listed}
    assert not names & {"passwd", "shadow", "hostname", "fuse.conf"}, (
        f"/etc listed through the etcdir link: {sorted(names)[:20]}")


def _chunk_probes(ext: np_ckpt.Synth) -> dict[str, bytes]:
    """The first 64 bytes of each chunk the outside shard holds (random, no
    zeros: found only where its bytes are served)."""
    return {fqn: a.tobytes()[:64] for fqn, (_, a) in ext.chunks[OUTSIDE_RANK].items()
            if a.nbytes >= 64}


def _served_segments(path: str) -> list[bytes]:
    """The runs of pages of ``path`` that read successfully (EIO splits them).
    A weight file refused at open (EIO: its checkpoint is incomplete, see
    SEMANTICS "Errors") serves nothing."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as e:
        assert e.errno == errno.EIO, (path, e)
        return []
    out, cur = [], b""
    for pr in read_pages(path):
        if pr.data is None:
            assert pr.err == errno.EIO, (path, pr.offset, pr.err)
            out.append(cur)
            cur = b""
        else:
            cur += pr.data
    return out + [cur]


def test_shard_linked_from_outside_not_used(link_tree):
    """`ckptfs check` names the linked shard as a problem (exit 5), and no
    view of ext serves the bytes it holds."""
    m, src, _, ext = link_tree
    r = run_ckptfs("check", src, text_stdout=True)
    name = np_ckpt.shard_name(OUTSIDE_RANK)
    assert r.returncode == 5 and name in r.stdout + r.stderr, (
        f"check did not report the shard linked from outside: rc={r.returncode}\n"
        f"{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
    probes = _chunk_probes(ext)
    assert probes
    files = [m.p("ext", rel) for rel in np_ckpt.virtual_files(ext)]
    for path in files:
        if not os.path.exists(path):
            continue
        for seg in _served_segments(path):
            hits = [fqn for fqn, probe in probes.items() if probe in seg]
            assert not hits, f"{path} serves the outside shard's bytes of {hits}"


def test_relative_link_to_checkpoint(link_tree):
    """latest -> step_200 and zz_latest -> step_200 (sorting before and after
    their target): every name gives the same consolidated bytes, those of
    step_200's tensors."""
    m, _, step, _ = link_tree
    rel = "consolidated/model.safetensors"
    data = {name: read(m.p(name, rel)) for name in ("latest", "step_200", "zz_latest")}
    np_ckpt.check_consolidated(data["step_200"], step)
    assert data["latest"] == data["step_200"] == data["zz_latest"]
