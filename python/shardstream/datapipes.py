"""``StreamingPipe``: a ``StreamingDataset`` as a torch ``IterDataPipe``, for
torchdata's ``DataLoader2`` (torchdata 0.9 and earlier).

``DataLoader2``'s reading services shard a pipeline by calling
``apply_sharding`` on its sharding pipes: ``DistributedReadingService`` once
per rank, ``MultiProcessingReadingService`` once in each worker. This pipe
takes those calls as its slot of the plan (rank and world size, worker id
and worker count), so each rank and worker reads only its own shards and
samples, cut before any byte is read, instead of every worker reading
everything and a ``sharding_filter`` dropping what is not its own. Put no
``sharding_filter`` in front of it.

    from torchdata.dataloader2 import (
        DataLoader2, DistributedReadingService, MultiProcessingReadingService,
        SequentialReadingService)
    from shardstream.datapipes import StreamingPipe

    pipe = StreamingPipe(StreamingDataset("data/shard-{000000..000127}.tar"))
    pipe = pipe.map(decode).batch(32)
    service = SequentialReadingService(
        DistributedReadingService(), MultiProcessingReadingService(num_workers=4))
    loader = DataLoader2(pipe, reading_service=service)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

from .dataset import StreamingDataset, count_for_ranks

__all__ = ["StreamingPipe"]


class StreamingPipe(IterDataPipe[Any]):
    """Streams ``dataset``'s samples (or batches) as an ``IterDataPipe``;
    ``DataLoader2``'s sharding sets its slot (see the module docstring).

    Each pass is the dataset's next epoch, in each worker as in a
    ``DataLoader`` (``dataset.set_epoch`` before the pass sets it).
    """

    def __init__(self, dataset: StreamingDataset) -> None:
        super().__init__()
        if not isinstance(dataset, StreamingDataset):
            raise TypeError(
                f"StreamingPipe takes a shardstream.StreamingDataset, got {type(dataset).__name__}"
            )
        self.dataset = dataset

    def apply_sharding(
        self,
        num_of_instances: int,
        instance_id: int,
        sharding_group: SHARDING_PRIORITIES = SHARDING_PRIORITIES.DEFAULT,
    ) -> None:
        """Takes slot ``instance_id`` of ``num_of_instances``: ranks for the
        ``DISTRIBUTED`` group, workers for ``MULTIPROCESSING``, and, for the
        ``DEFAULT`` group (one flat split), slots of as many ranks of one
        worker each."""
        for name, value in (("num_of_instances", num_of_instances), ("instance_id", instance_id)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if not 0 <= instance_id < num_of_instances:
            raise ValueError(
                f"instance_id must be in [0, num_of_instances), got {instance_id} of "
                f"{num_of_instances}"
            )
        ds = self.dataset
        if sharding_group == SHARDING_PRIORITIES.DISTRIBUTED:
            ds.rank, ds.world_size = instance_id, num_of_instances
        elif sharding_group == SHARDING_PRIORITIES.MULTIPROCESSING:
            ds.worker_id, ds.num_workers = instance_id, num_of_instances
            # This process is a worker: it advances its own epochs.
            ds._epochs.pipe_worker = (instance_id, num_of_instances)
        else:
            ds.rank, ds.world_size = instance_id, num_of_instances
            ds.worker_id, ds.num_workers = 0, 1
        _, world_size = ds.distributed_slot()
        count_for_ranks(ds.shard_list, world_size)
        ds.shard_list.check_equal_length(world_size)

    def __iter__(self) -> Iterator[Any]:
        yield from self.dataset
