"""Profiles a real job measured (recorded, not computed): ResNet-18 at 112 px frozen to
layer3, 93 KB photos, `hapi serve` and the trainer on a core each of one 2-core x86_64
machine over loopback, `lossy_wire=True` - the setting of `benchmarks/wire_epochs.py`.
The codec tests weigh the planner's codec rules against them at the benchmark's rates."""

# ruff: noqa: E501 - one cut per entry, one line per measured tuple: a table, read across.
from __future__ import annotations

from hapi.plan import CodecProfile, ServerProfile, TrainerProfile

NAMES = ("conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1", "layer2.0", "layer2",
         "layer3.0", "layer3")  # fmt: skip

# fmt: off
SERVER = ServerProfile(
    read_s=0.0004331,
    decode_s=0.003469,
    head_s=(0.0, 0.001645, 0.002186, 0.002774, 0.005409, 0.009163, 0.01279, 0.01557, 0.01785, 0.02002, 0.02248),
    out_bytes=(150_563, 802_851, 802_851, 802_851, 200_739, 200_739, 200_739, 100_387, 100_387, 50_211, 50_211),
    memory_bytes=(496_742, 2_152_550, 2_152_550, 2_152_550, 2_152_550, 2_152_550, 2_152_550, 2_152_550, 2_152_550, 2_152_550, 2_152_550),
    raw_bytes=93670.0,
    batch_size=32,
    raw_s=0.0006789,
    send_s=1.222e-08,
)
TRAINER = TrainerProfile(
    decode_s=0.002389,
    head_s=(0.0, 0.002092, 0.002789, 0.003698, 0.005133, 0.006834, 0.008814, 0.01052, 0.01251, 0.01479, 0.01723),
    tail_s=(0.03619, 0.0341, 0.0334, 0.03249, 0.03106, 0.02936, 0.02738, 0.02567, 0.02368, 0.02141, 0.01896),
    batch_size=32,
    receive_s=5.614e-09,
)
CODECS = (
    CodecProfile(
        wire_dtype="fp32",
        compression="none",
        out_bytes=(150_541, 802_829, 802_829, 802_829, 200_717, 200_717, 200_717, 100_365, 100_365, 50_189, 50_189),
        encode_s=(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
        decode_s=(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
        lossy=False,
    ),
    CodecProfile(
        wire_dtype="fp32",
        compression="lz4",
        out_bytes=(78_037, 802_977, 802_977, 442_159, 119_479, 150_761, 149_181, 53_435, 70_399, 29_795, 37_649),
        encode_s=(0.0, 0.0004682, 0.0003344, 0.0008057, 0.0005144, 0.0003507, 0.0003075, 0.0001794, 0.0001689, 0.0001004, 9.076e-05),
        decode_s=(9.808e-05, 0.0003824, 0.0002347, 0.0003705, 0.000146, 0.0001073, 0.0001225, 5.111e-05, 4.444e-05, 5.164e-05, 4.171e-05),
        lossy=False,
    ),
    CodecProfile(
        wire_dtype="fp32",
        compression="zstd",
        out_bytes=(61_389, 740_353, 741_241, 388_291, 105_415, 132_961, 131_281, 46_439, 61_721, 25_723, 32_705),
        encode_s=(0.0, 0.001386, 0.001642, 0.00208, 0.0007849, 0.0005875, 0.0005084, 0.0003266, 0.0003779, 0.0002275, 0.0002298),
        decode_s=(0.0001919, 0.001281, 0.001111, 0.0009312, 0.0002816, 0.0002737, 0.0002955, 0.0001439, 0.0001601, 0.000113, 0.0001246),
        lossy=False,
    ),
    CodecProfile(
        wire_dtype="fp16",
        compression="none",
        out_bytes=(75_277, 401_421, 401_421, 401_421, 100_365, 100_365, 100_365, 50_189, 50_189, 25_101, 25_101),
        encode_s=(0.0, 4.465e-05, 5.335e-05, 6.937e-05, 1.638e-05, 2.722e-05, 8.518e-07, 1.584e-05, 1.125e-05, 6.387e-06, 0.0),
        decode_s=(0.0, 0.0, 0.0, 0.0, 0.0, 2.374e-06, 0.0, 0.0, 0.0, 0.0, 1.226e-05),
        lossy=True,
    ),
    CodecProfile(
        wire_dtype="int8",
        compression="zstd",
        out_bytes=(36_637, 197_151, 197_151, 111_905, 33_699, 38_487, 38_153, 14_445, 18_665, 7_297, 9_031),
        encode_s=(0.0, 0.00209, 0.002076, 0.001705, 0.0006098, 0.000802, 0.0006655, 0.0003671, 0.0003205, 0.0002355, 0.000225),
        decode_s=(0.0001358, 0.0004753, 0.0004964, 0.000473, 0.0001924, 0.0002263, 0.0001992, 0.0001016, 0.0001187, 7.475e-05, 9.503e-05),
        lossy=True,
    ),
)
# fmt: on
"""fp32 with none, lz4 and zstd, then fp16 and int8 + zstd (of the 12 it measured)."""
LOOPBACK_BYTES_PER_S = 75690000.0
"""The link it measured (loopback, with the server's one core sending)."""
