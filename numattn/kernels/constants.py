"""Constants shared by the kernels and the ops: the softmax runs in base 2 (``exp2``, ``log2``)."""

import math

import numpy as np

LOG2E = math.log2(math.e)  # exp(x) = exp2(x · LOG2E)
LN2 = math.log(2.0)  # ln(x) = log2(x) · LN2
LOG2E_F32, LN2_F32 = np.float32(LOG2E), np.float32(LN2)  # as float32 kernel constants
