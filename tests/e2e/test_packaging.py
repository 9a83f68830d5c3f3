"""The Debian package, installed with apt into a clean Debian root, mounts a
checkpoint.

The package is built with cpack from the build directory of $CKPTFS_BIN. The
clean root is `debootstrap --variant=minbase` of the host's own Debian suite
and mirror (read from /etc/apt/sources.list*), made once and cached as a
tarball under build/packaging-test/ together with apt's downloaded .debs,
so a rerun unpacks it in seconds. apt-get installs the .deb inside the root
(chroot), which resolves its dependencies from the mirror; `ckptfs mount`
and `mount -t fuse.ckptfs` then run in the chroot with /proc, /sys and
/dev/fuse bound in, and the test reads consolidated/ through the mountpoint
from the host with safetensors, comparing tensors with the originals.

Needs root (chroot, mount), debootstrap (tools/setup.sh installs it) and the
mirror. Phase timings go to build/packaging-test/timings.json.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import harness
from harness import describe, is_mounted

REPO = Path(__file__).resolve().parents[2]
# Bump when the recipe of the cached base root changes.
BASE_RECIPE = 1
CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C",
              "DEBIAN_FRONTEND": "noninteractive"}
SOURCE = "/srv/ckpt/step_1"  # the checkpoint, inside the root
TIMINGS: dict[str, float] = {}


def build_dir() -> Path:
    return Path(harness.require_bin()).resolve().parent


def run(cmd, *, env=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    """Runs cmd with output through temp files (a daemonized ckptfs must not
    hold a pipe of ours); stdout and stderr come back as text."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.run([str(c) for c in cmd], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                           env=env, timeout=timeout)
        out.seek(0)
        err.seek(0)
        p = subprocess.CompletedProcess(p.args, p.returncode, out.read().decode(errors="replace"),
                                        err.read().decode(errors="replace"))
    if check:
        assert p.returncode == 0, describe(p)
    return p


def timed(phase: str, fn, *args, **kwargs):
    t0 = time.monotonic()
    result = fn(*args, **kwargs)
    TIMINGS[phase] = round(time.monotonic() - t0, 2)
    return result


# ---------------------------------------------------------------------------
# the clean root
# ---------------------------------------------------------------------------


def host_debian_source() -> tuple[str, str]:
    """(mirror URI, suite) of the host's main Debian archive: the first `deb`
    entry whose suite has no -updates/-security suffix, in one-line
    sources.list or deb822 .sources form."""
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*"))]:
        if not os.path.isfile(path) or not path.endswith((".list", ".sources")):
            continue
        text = Path(path).read_text()
        if path.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^(\w[\w-]*):\s*(.+)$", stanza, re.M))
                if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
                    for suite in fields.get("Suites", "").split():
                        if "-" not in suite:
                            return fields["URIs"].split()[0], suite
        for m in re.finditer(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", text, re.M):
            if "-" not in m.group(2):
                return m.group(1), m.group(2)
    raise AssertionError("no Debian `deb` source in /etc/apt/sources.list*: the clean root needs a mirror")


def mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [harness._unescape_mount_path(line.split()[1]) for line in f]
    return [p for p in points if p.startswith(prefix)]


def remove_root(root: Path) -> None:
    """rm -rf of a root that must have nothing mounted under it any more (a
    bound /dev or /sys would otherwise be emptied)."""
    left = mounts_under(root)
    assert not left, f"still mounted under {root}, not removing it: {left}"
    run(["rm", "-rf", "--one-file-system", root])


def base_tarball(cache: Path) -> Path:
    """The cached minbase root of the host's suite, made on first use."""
    uri, suite = host_debian_source()
    tarball = cache / f"base-{suite}-minbase-r{BASE_RECIPE}.tar.gz"
    if tarball.exists():
        return tarball
    assert shutil.which("debootstrap"), "debootstrap is missing: run tools/setup.sh"
    work = cache / "base-build"
    if work.exists():
        remove_root(work)
    run(["debootstrap", "--variant=minbase", suite, work, uri], timeout=1200)
    # apt fetches fresh lists and .debs each run: the tarball keeps neither.
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (work / d).glob("*"):
            if p.is_file():
                p.unlink()
    partial = tarball.with_suffix(".partial")
    run(["tar", "--numeric-owner", "-C", work, "-czf", partial, "."])
    partial.rename(tarball)
    remove_root(work)
    return tarball


class Chroot:
    """A fresh root unpacked from the cached tarball, with /proc, /sys,
    /dev/fuse and the apt archive cache bound in; close() unmounts all of it
    (FUSE mounts first) and removes the root."""

    def __init__(self, tarball: Path, parent: Path, apt_cache: Path):
        self.root = Path(tempfile.mkdtemp(prefix="root-", dir=parent))
        self.mounted: list[Path] = []
        try:
            run(["tar", "--numeric-owner", "-C", self.root, "-xzpf", tarball])
            shutil.copyfile("/etc/resolv.conf", self.root / "etc/resolv.conf")
            (apt_cache / "partial").mkdir(parents=True, exist_ok=True)
            # Only the FUSE device, not all of /dev: nothing of the host's
            # /dev can be removed with the root.
            (self.root / "dev/fuse").touch()
            self._mount(["-t", "proc", "proc"], "proc")
            self._mount(["--bind", "/sys"], "sys")
            self._mount(["--bind", "/dev/fuse"], "dev/fuse")
            self._mount(["--bind", apt_cache], "var/cache/apt/archives")
        except BaseException:
            self.close()
            raise

    def _mount(self, args: list, rel: str) -> None:
        target = self.root / rel
        run(["mount", *args, target])
        self.mounted.append(target)

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def run(self, *cmd, env_extra=None, check=True, timeout=600) -> subprocess.CompletedProcess:
        """cmd in the root with CHROOT_ENV only; env_extra adds to it, and a
        None value removes that variable."""
        env = {k: v for k, v in dict(CHROOT_ENV, **(env_extra or {})).items() if v is not None}
        return run(["chroot", self.root, "env", "-i", *(f"{k}={v}" for k, v in env.items()), *cmd],
                   check=check, timeout=timeout)

    def close(self) -> None:
        for point in mounts_under(self.root):
            if point.startswith(str(self.root / "mnt")):
                harness.unmount(point)
        for target in reversed(self.mounted):
            run(["umount", "-l", target], check=False)
        remove_root(self.root)


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict:
    """{"deb": ..., "ddeb": ...}: the package and its debug symbols, made by
    cpack from a build brought up to date first."""
    assert os.geteuid() == 0, "test_packaging needs root (debootstrap, chroot, mount)"
    build = build_dir()
    assert (build / "CPackConfig.cmake").exists(), f"{build} is not a CMake build directory"
    out = tmp_path_factory.mktemp("cpack")
    # What the package installs; cpack itself builds nothing.
    timed("build", run, ["ninja", "-C", build, "ckptfs", "ckptfs_man"])
    timed("cpack", run, ["cpack", "--config", build / "CPackConfig.cmake", "-G", "DEB", "-B", out])
    debs = sorted(out.glob("ckptfs_*.deb"))
    ddebs = sorted(out.glob("ckptfs-dbgsym_*.ddeb"))
    assert len(debs) == 1 and len(ddebs) == 1, f"cpack made {sorted(p.name for p in out.iterdir())}"
    return {"deb": debs[0], "ddeb": ddebs[0]}


def write_checkpoint(dest: Path) -> dict[str, np.ndarray]:
    """A two-file Hugging Face folder written by safetensors itself."""
    rng = np.random.default_rng(8)
    first = {"model.embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
             "model.norm.weight": rng.standard_normal((8,)).astype(np.float16)}
    second = {"lm_head.weight": rng.integers(-2**40, 2**40, (5, 7), dtype=np.int64),
              "model.mask": rng.integers(0, 255, (3, 3), dtype=np.uint8)}
    dest.mkdir(parents=True)
    save_file(first, str(dest / "model-00001-of-00002.safetensors"))
    save_file(second, str(dest / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in second})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {**first, **second}


@pytest.fixture(scope="module")
def installed(packages, tmp_path_factory):
    """(Chroot, expected tensors, packages the install added): the .deb and
    its dbgsym installed by apt into a fresh clean root that also holds a
    checkpoint at SOURCE."""
    cache = build_dir() / "packaging-test"
    cache.mkdir(exist_ok=True)
    t0 = time.monotonic()
    tarball = timed("base root (debootstrap or cache)", base_tarball, cache)
    ch = timed("unpack root", Chroot, tarball, tmp_path_factory.mktemp("chroot"), cache / "apt-archives")
    try:
        before = set(ch.run("dpkg-query", "-W", "-f", "${Package}\\n").stdout.split())
        for key in ("deb", "ddeb"):
            shutil.copy(packages[key], ch.path("/root"))
        timed("apt-get update", ch.run, "apt-get", "update")
        timed("apt-get install", ch.run, "apt-get", "install", "-y", "--no-install-recommends",
              f"/root/{packages['deb'].name}", f"/root/{packages['ddeb'].name}")
        after = set(ch.run("dpkg-query", "-W", "-f", "${Package}\\n").stdout.split())
        original = tmp_path_factory.mktemp("ckpt") / "step_1"
        expected = write_checkpoint(original)
        shutil.copytree(original, ch.path(SOURCE))
        TIMINGS["setup total"] = round(time.monotonic() - t0, 2)
        yield ch, expected, after - before
    finally:
        ch.close()
        (cache / "timings.json").write_text(json.dumps(TIMINGS, indent=1))
        print("packaging test timings (s):", json.dumps(TIMINGS))


# ---------------------------------------------------------------------------
# the package itself
# ---------------------------------------------------------------------------


def host_package_of(lib: str) -> str:
    """The Debian package that owns a library ldd printed; dpkg knows each
    file under one spelling, /lib/... or /usr/lib/... (merged /usr)."""
    real = os.path.realpath(lib)
    candidates = [lib, real]
    for p in (lib, real):
        candidates.append(p[4:] if p.startswith("/usr/") else "/usr" + p)
    for path in candidates:
        p = run(["dpkg", "-S", path], check=False)
        if p.returncode == 0:
            return p.stdout.split(":")[0].strip()
    raise AssertionError(f"no package owns {lib} (tried {candidates})")


def depends_names(field: str) -> set[str]:
    return {re.match(r"\s*([a-z0-9][a-z0-9+.-]*)", d).group(1) for d in field.split(",")}


def host_libcurl() -> str:
    """Where the host's loader finds libcurl.so.4 (ldconfig's cache)."""
    m = re.search(r"^\s*libcurl\.so\.4 \(libc6,x86-64\) => (/\S+)$", run(["ldconfig", "-p"]).stdout, re.M)
    assert m, "ldconfig -p lists no libcurl.so.4"
    return m.group(1)


def test_depends_are_what_the_binary_links(packages):
    """Depends names exactly the packages of the libraries the binary links
    directly (its DT_NEEDED entries, found where ldd resolves them, owned
    per dpkg -S on the host), plus fuse3 for fusermount3 and libcurl's
    package, which is loaded on the first S3 request, not linked
    (source/curl_api.h). Libraries those pull in (libcurl's TLS and HTTP/2
    stack) are their packages' business."""
    binary = harness.require_bin()
    ldd = run(["ldd", binary]).stdout
    where = dict(re.findall(r"^\s*(\S+) => (/\S+) \(0x", ldd, re.M))
    # The dynamic loader, when the binary names it (it does once it uses
    # one of its symbols, e.g. for thread-local storage), is printed by path.
    where.update({os.path.basename(p): p for p in re.findall(r"^\s*(/\S+) \(0x", ldd, re.M)})
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run(["readelf", "-d", binary]).stdout)
    libs = [where[n] for n in needed if n in where]
    assert len(libs) == len(needed), (needed, ldd)
    assert any("libsnappy" in lib for lib in libs), ldd
    assert not any("libcurl" in n for n in needed), needed
    expected = {host_package_of(lib) for lib in libs} | {"fuse3", host_package_of(host_libcurl())}
    field = run(["dpkg-deb", "-f", packages["deb"], "Depends"]).stdout.strip()
    assert depends_names(field) == expected, f"Depends: {field}\nldd:\n{ldd}"


def build_id(path) -> str:
    m = re.search(r"Build ID: ([0-9a-f]+)", run(["readelf", "-n", path]).stdout)
    assert m, f"{path} has no build ID note"
    return m.group(1)


def debug_sections(path) -> list[str]:
    return re.findall(r"\] (\.debug_\w+)", run(["readelf", "-SW", path]).stdout)


def test_binary_is_stripped_and_dbgsym_holds_its_debug_info(installed):
    ch, _, _ = installed
    binary = ch.path("/usr/bin/ckptfs")
    assert debug_sections(binary) == [], "the installed binary still carries DWARF"
    assert binary.stat().st_size < 20 << 20, f"{binary.stat().st_size} bytes: not stripped?"
    bid = build_id(binary)
    debug_file = ch.path(f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug")
    assert debug_file.exists(), f"ckptfs-dbgsym has no {debug_file.name} for build ID {bid}"
    assert build_id(debug_file) == bid
    assert ".debug_info" in debug_sections(debug_file)


def test_apt_resolved_dependencies_in_the_clean_root(installed, packages):
    ch, _, added = installed
    # Not in minbase: apt had to fetch them because the .deb asked for them.
    assert {"ckptfs", "ckptfs-dbgsym", "fuse3", "libfuse3-3", "libsnappy1v5", host_package_of(host_libcurl())} <= added, added
    ldd = ch.run("ldd", "/usr/bin/ckptfs").stdout
    assert "not found" not in ldd, ldd
    version = run(["dpkg-deb", "-f", packages["deb"], "Version"]).stdout.strip()
    assert ch.run("ckptfs", "--version").stdout.strip() == f"ckptfs {version}"
    assert ch.path("/usr/bin/fusermount3").exists()
    # libcurl came with the package and loads: an s3:// root with no server
    # behind its endpoint fails connecting, not loading libcurl.
    r = ch.run("ckptfs", "ls", "s3://bucket/prefix", "--endpoint-url", "http://127.0.0.1:9",
               env_extra={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}, check=False, timeout=60)
    assert r.returncode != 0 and "cannot load" not in r.stderr, r.stderr
    assert "is the endpoint right" in r.stderr, r.stderr


def test_docs_are_shipped(installed):
    ch, _, _ = installed
    doc = ch.path("/usr/share/doc/ckptfs")
    for src in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        assert (doc / src.name).read_bytes() == src.read_bytes(), f"{doc / src.name} differs from {src}"
    assert (doc / "PACKAGING.md").read_bytes() == (REPO / "packaging/README.md").read_bytes()


def help_terms(help_text: str) -> list[str]:
    """The first column of every positional and flag line of a CLI11 --help
    ("ROOT", "-f,--foreground", "--threads")."""
    terms, section = [], None
    for line in help_text.splitlines():
        if re.fullmatch(r"(Positionals|Options|Subcommands):", line):
            section = line[:-1]
        elif not line.strip():
            section = None
        elif section in ("Positionals", "Options") and (m := re.match(r"  (\S+)", line)):
            terms.append(m.group(1))
    return terms


def test_man_page_documents_every_flag(installed):
    """Each subcommand's section of `man ckptfs` names every positional and
    flag that the installed binary's --help lists."""
    ch, _, _ = installed
    page = run(["man", "-l", ch.path("/usr/share/man/man1/ckptfs.1.gz")],
               env={"PATH": os.environ["PATH"], "LC_ALL": "C", "MANWIDTH": "400"}).stdout
    top = ch.run("ckptfs", "--help").stdout
    subs = re.findall(r"^  (\w+) ", top.split("Subcommands:\n")[1].split("\n\n")[0], re.M)
    assert {"index", "mount", "ls", "cat", "export"} <= set(subs), top
    for sub in subs:
        m = re.search(rf"^   ckptfs {sub} \[OPTIONS\].*?(?=^   ckptfs |^[A-Z])", page, re.M | re.S)
        assert m, f"man page has no section for `ckptfs {sub}`"
        for term in help_terms(ch.run("ckptfs", sub, "--help").stdout):
            assert re.search(rf"^       {re.escape(term)}(\s|$)", m.group(0), re.M), (
                f"`ckptfs {sub}`: {term} is not in the man page:\n{m.group(0)}")
    for term in help_terms(top):
        assert re.search(rf"^       {re.escape(term)}(\s|$)", page.split("\nCOMMANDS\n")[0], re.M), term


def test_man_page_names_every_fstab_option():
    """The man page's fstab paragraph lists every option the mount helper
    turns into a flag (no install needed: both are sources)."""
    helper = (REPO / "packaging/mount.ckptfs").read_text()
    options = re.findall(r"^    (\w+)(?:=\*)?\) (?:set --|index=)", helper, re.M)
    assert {"allow_other", "max_file_size", "index", "verify_checksums", "no_watch"} <= set(options), options
    page = (REPO / "packaging/ckptfs.1.in").read_text()
    paragraph = re.search(r"^Options: (.*?)are ignored", page, re.M | re.S).group(1)
    listed = set(re.findall(r"\b(\w+)(?:=\w+)?[,;( ]", paragraph))
    assert set(options) <= listed, f"not in the man page: {sorted(set(options) - listed)}"


# ---------------------------------------------------------------------------
# mounting inside the root
# ---------------------------------------------------------------------------


def assert_consolidated(mnt: Path, expected: dict[str, np.ndarray]) -> None:
    """consolidated/model.safetensors read through the mount by safetensors
    holds each original tensor, same dtype, same values."""
    got = load_file(str(mnt / "consolidated" / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert np.array_equal(got[name], want), name


def fnv1a64_name(abs_path: str) -> str:
    """<name>-<hash> of an index for abs_path as docs/CLI.md describes it:
    FNV-1a 64 of the path's bytes with ckptfs's offset basis."""
    h = 1469598103934665603
    for byte in abs_path.encode():
        h = ((h ^ byte) * 1099511628211) % 2**64
    return f"{os.path.basename(abs_path)}-{h:016x}"


def test_ckptfs_mount_in_the_clean_root(installed):
    """`ckptfs mount` returns only once the mount answers (what the
    Type=forking unit relies on): no waiting between its exit and the reads."""
    ch, expected, _ = installed
    mnt = ch.path("/mnt/direct")
    mnt.mkdir()
    t0 = time.monotonic()
    ch.run("ckptfs", "mount", SOURCE, "/mnt/direct")
    try:
        assert is_mounted(mnt), "ckptfs mount exited before the file system was mounted"
        assert "model.safetensors" in os.listdir(mnt / "consolidated")
        assert_consolidated(mnt, expected)
        TIMINGS["ckptfs mount + read"] = round(time.monotonic() - t0, 2)
    finally:
        unmounted = ch.run("fusermount3", "-u", "/mnt/direct", check=False)
    assert unmounted.returncode == 0, describe(unmounted)
    assert not is_mounted(mnt)


def test_fstab_helper_mounts_with_the_system_index(installed):
    """mount(8) runs /sbin/mount.fuse.ckptfs without HOME: the index goes to
    /var/cache/ckptfs under the name ckptfs itself computes, the helper says
    so, and nothing is built under /tmp."""
    ch, expected, _ = installed
    mnt = ch.path("/mnt/fstab")
    mnt.mkdir()
    index = "/var/cache/ckptfs/" + fnv1a64_name(SOURCE)
    p = ch.run("mount", "-t", "fuse.ckptfs", SOURCE, "/mnt/fstab", "-o", "ro,allow_other,_netdev",
               env_extra={"HOME": None})
    try:
        assert f"mount.ckptfs: {SOURCE} on /mnt/fstab, index {index}\n" in p.stderr, describe(p)
        assert is_mounted(mnt)
        assert_consolidated(mnt, expected)
        assert ch.path(index).is_dir()
        # ckptfs's fallback without HOME is /tmp/ckptfs-<uid>.
        assert not ch.path("/tmp/ckptfs-0").exists(), "an index was built under /tmp"
    finally:
        unmounted = ch.run("umount", "/mnt/fstab", check=False)
    assert unmounted.returncode == 0, describe(unmounted)
    # ckptfs's own default with CKPTFS_INDEX_DIR names the same directory.
    idx = ch.run("ckptfs", "index", SOURCE, env_extra={"CKPTFS_INDEX_DIR": "/var/cache/ckptfs"})
    assert idx.stderr.rstrip().endswith(f"-> {index}"), describe(idx)
