"""Split-KV workspaces: fp32 partial results and the counters with which the last block of a
launch to finish finds out that it merges them (``kernels.decode.last_to_finish``)."""

import numpy as np


class WorkspaceLayout:
    """A split launch's workspace in 4-byte words: the int32 counters first (rounded up to 16
    bytes), then the fp32 partial outputs, then their log2-sum-exps, from the shapes of those
    three parts as ``(part, part_lse, counters)``."""

    def __init__(self, shapes):
        part, part_lse, counters = (int(np.prod(shape)) for shape in shapes)
        self.counter_words = -(-counters // 4) * 4
        self.words = self.counter_words + part + part_lse
        self.part_lse_offset = 4 * part  # bytes from the partial outputs to their log2-sum-exps

    def partials(self, base):
        """``(part, part_lse)`` pointers of a workspace at device address ``base`` laid out as above."""
        part = base + 4 * self.counter_words
        return part, part + self.part_lse_offset


def capture_check(torch):
    """torch's cheapest test of whether it captures a CUDA graph on its current stream (a private fast
    path where it has one), as a function of no arguments."""
    return getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def capturing_now(torch):
    """Whether torch captures a CUDA graph on its current stream."""
    return capture_check(torch)()


_BUFFERS = {}  # (device, stream) -> (counters pointer, partials pointer, buffer, counter words, partial words)


class SplitWorkspaces:
    """Split-KV workspaces of torch launches, one per (device, stream).

    A workspace is one int32 buffer: a region of counters, zero when no launch
    is running (each launch's merging blocks set theirs back to 0), then room for
    partial results. Launches on one stream run in order, so every plan
    on a stream shares its workspace; a larger need replaces it with a larger
    zeroed one (torch's allocator reuses the old one only after the stream's
    earlier work). While torch captures a CUDA graph each call gets its own
    zeroed buffer, allocated (and its zeroing recorded) in the graph.
    """

    @staticmethod
    def getter(torch, device, counter_words, words):
        """``get(stream)``: ``(counters pointer, partials pointer, buffer)`` of a workspace on ``stream`` with at
        least ``counter_words`` zero counters and ``words - counter_words`` words for partials after all of its
        counters; the buffer must stay referenced until the launch is queued. Bound once per plan: a call is a
        dictionary lookup while the stream's workspace is large enough and no graph is being captured."""
        capturing, partial_words = capture_check(torch), words - counter_words

        def get(stream):
            if stream and capturing():  # the legacy default stream (handle 0) cannot capture
                buffer = torch.zeros(words, dtype=torch.int32, device=torch.device("cuda", device))
                return buffer.data_ptr(), buffer.data_ptr() + 4 * counter_words, buffer
            entry = _BUFFERS.get((device, stream))
            if entry is None or entry[3] < counter_words or entry[4] < partial_words:
                counters = max(counter_words, entry[3] if entry else 0)
                rest = max(partial_words, entry[4] if entry else 0)
                buffer = torch.zeros(counters + rest, dtype=torch.int32, device=torch.device("cuda", device))
                pointer = buffer.data_ptr()
                entry = _BUFFERS[(device, stream)] = (pointer, pointer + 4 * counters, buffer, counters, rest)
            return entry[0], entry[1], entry[2]

        return get
