"""The index kinds, one registered object each (`index.kinds.base`): the float32 kinds
(`floats`: flat, ivf, hnsw), the code kinds (`codes`: ivfsq8, ivfpq, opq), the mixed
4/8-bit kind (`mixed`: ivfsq48) and the scanned-prefix kind (`prefix`: scanprefix).
Importing this package registers them all."""

from index.kinds import codes, floats, mixed, prefix  # noqa: F401 - each registers its kinds
from index.kinds.base import (
    KINDS,
    DoesNotFit,
    Kind,
    choose,
    get,
    parse_bytes,
    reconstruct_all,
    register,
    resolve,
)

__all__ = ["KINDS", "DoesNotFit", "Kind", "choose", "get", "parse_bytes", "reconstruct_all",
           "register", "resolve"]
