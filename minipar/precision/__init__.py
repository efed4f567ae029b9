"""Mixed precision, one idea per file: ``formats`` (what FP32, FP16, BF16 and FP8 E4M3/E5M2 can represent),
``loss_scaler`` (dynamic loss scaling, from scratch), ``mixed`` (FP32 master weights, 16-bit compute), ``fp8``
(FP8 GEMMs with tensor-, row- and block-wise scales, current or delayed), ``mxfp8`` (OCP MXFP8: 1×32 blocks,
E8M0 power-of-two scales), ``accumulation`` (a k-bit accumulator
with FP32 promotion), ``fp8_train`` (BF16 vs FP8 training) and ``fp8_gather`` (the FP8 weight all-gather).
Import from the submodule: ``from minipar.precision.mixed import MixedPrecision``."""
