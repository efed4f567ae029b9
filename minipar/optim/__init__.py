"""Optimizers that shape the parallel design: Muon (one device in :mod:`.muon`; under ZeRO-1 and FSDP in
:mod:`.muon_sharded`; under tensor parallelism in :mod:`.muon_tp`)."""
