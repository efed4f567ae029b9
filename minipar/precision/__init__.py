"""Mixed precision, one idea per file: ``formats`` (what FP32, FP16 and BF16 can represent),
``loss_scaler`` (dynamic loss scaling, from scratch) and ``mixed`` (FP32 master weights, 16-bit compute).
Import from the submodule: ``from minipar.precision.mixed import MixedPrecision``."""
