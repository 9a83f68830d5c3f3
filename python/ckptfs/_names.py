"""The names of the files a ckptfs save writes into a step: torch's own
(DCP's ``__R_N.distcp``, the HF layout's sharded safetensors). The one
place the writer decides by name which files of a step are a save's, so
that a user's ``backup-shard-00001-model-00001-of-00001.safetensors`` or
``notes__0_0.distcp`` is never taken for one: whole names only."""

from __future__ import annotations

import re

DCP_RANK_FILE = re.compile(r"__\d+_\d+\.distcp")
HF_SHARD = re.compile(r"shard-(\d+)-model-\d+-of-\d+\.safetensors")
HF_TMP_SUFFIX = ".tmp"  # a local HF shard until the coordinator publishes it


def is_rank_file(name: str, layout: str | None = None) -> bool:
    """``name`` (a file name, no directory) is a rank file of ``layout``
    ("dcp" or "hf"; None: of either)."""
    dcp = layout in (None, "dcp") and DCP_RANK_FILE.fullmatch(name) is not None
    return dcp or (layout in (None, "hf") and HF_SHARD.fullmatch(name) is not None)


def is_hf_shard(name: str, tmp: bool = False) -> bool:
    """A shard file of the HF layout (with ``tmp``: or its unpublished
    ``.tmp``, as a local save leaves it before the commit)."""
    if tmp and name.endswith(HF_TMP_SUFFIX):
        name = name[: -len(HF_TMP_SUFFIX)]
    return HF_SHARD.fullmatch(name) is not None


def shard_rank(name: str) -> int:
    """The 1-based rank number of an HF shard's name."""
    return int(HF_SHARD.fullmatch(name).group(1))


def other_layout_files(names, layout: str) -> list[str]:
    """Of ``names`` (file names in a step), those of the layout that is not
    ``layout``: what a save of ``layout`` would leave beside its own files."""
    other = "hf" if layout == "dcp" else "dcp"
    return sorted(n for n in names if is_rank_file(n, other) or (other == "hf" and is_hf_shard(n, tmp=True)))
