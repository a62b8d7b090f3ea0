"""Register budgets of a block: the registers per thread one block may start with, and how ``setmaxnreg``
divides them between a producer warpgroup and the computing ones."""


def block_registers(num_threads):
    """Registers per thread that let one block of ``num_threads`` threads fit an SM: each of its four
    schedulers holds 16K."""
    warps_per_scheduler = -(-num_threads // 128)
    return min(255, 16384 // (32 * warps_per_scheduler) // 8 * 8)


def consumer_registers(num_threads, warpgroups, producer_registers):
    """Registers per thread of each of ``warpgroups`` computing warpgroups beside a producer warpgroup that keeps
    ``producer_registers``: the block's registers at launch less the producer's (``setmaxnreg`` moves registers
    within the block; asking for more waits forever)."""
    pool = block_registers(num_threads) * num_threads - 128 * producer_registers
    return min(256, pool // (128 * warpgroups) // 8 * 8)
