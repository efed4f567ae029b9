"""Data parallelism, one strategy per file: ``dp`` (threads, like ``nn.DataParallel``),
``parameter_server``, ``ddp`` (from scratch, bucketed, overlapped), ``sampler``, ``zero`` (ZeRO-1/2/3)
and ``fsdp``. Import from the submodule: ``from minipar.data.ddp import DistributedDataParallel``."""
