"""Paged caches described other ways: ``numattn.csr_page_table`` turns FlashInfer's CSR description into
the page table and lengths that ``paged_decode`` takes."""

import numpy as np


def csr_page_table(kv_indptr: np.ndarray, kv_indices: np.ndarray, kv_last_page_len: np.ndarray,
                   page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(page_table, seqlens)`` from FlashInfer's CSR description of a paged cache.

    Sequence ``b`` uses pages ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]``, its last one
    filled to ``kv_last_page_len[b]``. Host (numpy) arrays in (an empty list is an empty index
    array), int32 numpy arrays out; the table's unused entries are 0. A batch has at least one
    sequence (as ``paged_decode`` takes); the page indices used must lie in ``[0, 2**31 - 1]`` and
    the lengths must not exceed ``2**31 - 1`` (``ValueError`` otherwise: nothing wraps). Converting
    once per batch layout keeps the decode call free of host work.
    """
    int32_max = int(np.iinfo(np.int32).max)
    arrays = []
    for name, x in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
        x = np.asarray(x)
        if x.ndim == 1 and x.size == 0:
            x = x.astype(np.int64)  # np.asarray([]) is float64
        if x.dtype.kind not in "iu" or x.ndim != 1:
            raise TypeError(f"{name} must be a 1-D integer array, got {x.dtype} with shape {x.shape}")
        arrays.append(x)
    indptr, indices, last = arrays
    batch = len(indptr) - 1
    if batch < 1:
        raise ValueError(f"kv_indptr must have batch + 1 entries for a batch of at least 1 sequence, got {len(indptr)}")
    if len(last) != batch:
        raise ValueError(f"kv_last_page_len must have one entry per sequence ({batch}), got {len(last)}")
    if indptr[0] != 0 or (indptr[1:] < indptr[:-1]).any() or indptr[-1] > len(indices):
        raise ValueError("kv_indptr must start at 0, not decrease, and end within kv_indices")
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    counts = np.diff(indptr)
    bad = (last < 0) | (last > page_size) | ((last == 0) & (counts > 0))
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(f"kv_last_page_len[{b}] = {last[b]} is not in [{1 if counts[b] else 0}, {page_size}]")
    used = indices[: indptr[-1]]
    bad = (used < 0) | (used > int32_max)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"kv_indices[{i}] = {used[i]} is not a page index in [0, {int32_max}] (int32)")
    lengths = [(int(n) - 1) * int(page_size) + int(filled) if n else 0 for n, filled in zip(counts, last, strict=True)]
    for b, length in enumerate(lengths):
        if length > int32_max:
            raise ValueError(f"sequence {b} is {length} keys long ({counts[b]} pages of page_size {page_size}, "
                             f"kv_last_page_len[{b}] = {last[b]}): seqlens must be at most {int32_max} (int32)")
    table = np.zeros((batch, max(1, int(counts.max()))), np.int32)
    for b in range(batch):
        table[b, : counts[b]] = indices[indptr[b] : indptr[b + 1]]
    return table, np.array(lengths, np.int32)
