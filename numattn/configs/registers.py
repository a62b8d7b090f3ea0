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


class WarpgroupBlock:
    """Threads and register budgets of a block of ``warpgroups`` computing warpgroups and, with ``producer``,
    one more that copies (the wgmma configurations derive from it and name their ``producer_registers``)."""

    @property
    def num_threads(self):
        return 128 * (self.warpgroups + self.producer)

    @property
    def consumer_registers(self):
        """Registers per thread of a computing warpgroup beside a producer (``consumer_registers``)."""
        return consumer_registers(self.num_threads, self.warpgroups, self.producer_registers)

    @property
    def max_registers(self):
        """Registers per thread that let one block fit (``block_registers``)."""
        return block_registers(self.num_threads)
