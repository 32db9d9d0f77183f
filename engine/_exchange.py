"""SCHEDULE's exchange with the front door: new requests and cancels in, outputs out.

One rank: the front door is local; outputs go straight to it. Several ranks: rank 0 holds
the front door; the other ranks' outputs travel to it in SCHEDULE's one all-gather.
"""

from __future__ import annotations

import torch

from ._frontdoor import FrontDoorMessage, RankReport, assign_least_loaded
from ._request import RequestOutput
from ._wire import decode_outputs, encode_outputs


class OutputExchange:
    """``await exchange()`` -> the front door's message for this iteration;
    ``deliver(handle, output)`` hands one output towards the front door."""

    def __init__(self, *, config, comm, front, scheduler, device) -> None:
        self.config = config
        self.comm = comm
        self.front = front          # FrontDoor on rank 0, None elsewhere
        self.scheduler = scheduler
        self.device = device
        self.k = config.speculative.k
        self.pending: list[tuple[int, RequestOutput]] = []
        # Requests per rank, as of the last SYNC: where rank 0 assigns new requests.
        self.loads = [0] * comm.world_size
        self._exchange = self._group if comm.world_size > 1 else self._local

    async def __call__(self) -> FrontDoorMessage:
        return await self._exchange()

    def deliver(self, handle: int, output: RequestOutput) -> None:
        if self.front is not None:
            self.front.deliver((output,))
        else:
            self.pending.append((handle, output))

    async def _local(self) -> FrontDoorMessage:
        if self.scheduler.num_requests == 0:
            await self.front.wait_for_work(timeout=None)
        return self.front.take_message(lambda new: tuple((0, r) for r in new))

    async def _group(self) -> FrontDoorMessage:
        """One tensor all-gather: each serving rank's outputs as a fixed-size block, and
        a flag; only when some rank raised it (rank 0 has requests, cancels or shutdown
        to send; an output block overflowed) does a pickled object exchange follow. The
        flags are gathered first, so every rank agrees on whether it happens."""
        message, pending = FrontDoorMessage(), self.pending
        self.pending = []
        if self.front is not None:
            if self.scheduler.num_requests == 0 and sum(self.loads) == 0:
                await self.front.wait_for_work(timeout=self.config.scheduler.idle_wait_s)
            message = self.front.take_message(
                lambda new: assign_least_loaded(new, self.loads))
        rows = self.scheduler.slots.num_slots
        block = encode_outputs(pending, rows, self.k)
        flag = (message != FrontDoorMessage()) or block is None
        if block is None:
            block = encode_outputs((), rows, self.k)
        header = torch.cat([torch.tensor([int(flag)]), block]).to(self.device)
        gathered = (await self.comm.all_gather(header)).cpu()      # [world, 1 + rows*width]
        if self.front is not None:
            for flat in gathered[1:, 1:]:
                self.front.deliver(decode_outputs(flat, self.k, self.front.request_id))
        if bool(gathered[:, 0].any()):
            overflow = () if not pending or not gathered[self.comm.rank, 0] else pending
            reports = await self.comm.all_gather_object(
                message if self.front is not None else
                RankReport(tuple(out for _, out in overflow)))
            if self.front is not None:
                for report in reports[1:]:
                    self.front.deliver(report.outputs)
            message = reports[0]
        return message
