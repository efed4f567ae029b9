"""The FP8 all-gather on 4 ranks: every rank gets each piece exactly as its owner quantized it, and the
wire carries 1 byte per element — half of BF16's, a quarter of FP32's (observed on the sockets)."""
import pytest
import torch

from minipar import comm
from minipar import wire
from minipar.launcher import launch
from minipar.precision.fp8 import quantize
from minipar.precision.fp8_gather import all_gather_bytes

N, NUMEL = 4, 1 << 18


def _all(rank, world_size):
    return {str(d): all_gather_bytes(rank, world_size, NUMEL, d) for d in
            (torch.float32, torch.bfloat16, torch.float8_e4m3fn)}


@pytest.fixture(scope="module")
def results():
    return launch(_all, N, quiet=True)


def test_every_rank_gets_each_piece_as_its_owner_quantized_it(results):
    shards = [r["torch.float8_e4m3fn"][3] for r in results]
    want = torch.cat([quantize(s.reshape(1, -1)).dequantize().reshape(-1) for s in shards])
    for r in results:
        assert torch.equal(r["torch.float8_e4m3fn"][2], want)
        assert torch.equal(r["torch.float32"][2], torch.cat(shards))
    err = float((want - torch.cat(shards)).abs().max() / torch.cat(shards).abs().max())
    assert 0 < err <= 2.0 ** -4                                          # E4M3: half an ulp of the amax


def test_fp8_halves_bf16_on_the_wire(results):
    mean = {d: sum(r[d][0] for r in results) / N for d in results[0]}
    fp8 = mean["torch.float8_e4m3fn"]
    assert fp8 == comm.predicted_bytes_sent("all_gather", N * NUMEL, N) + comm.predicted_bytes_sent(
        "all_gather", 4 * N, N)
    assert mean["torch.bfloat16"] == 2 * comm.predicted_bytes_sent("all_gather", N * NUMEL, N)
    if wire.available():
        observed = {d: sum(r[d][1] for r in results) / N for d in results[0]}
        assert 0.49 < observed["torch.float8_e4m3fn"] / observed["torch.bfloat16"] < 0.52, observed
        assert 0.24 < observed["torch.float8_e4m3fn"] / observed["torch.float32"] < 0.27, observed
        assert observed["torch.float8_e4m3fn"] >= fp8
