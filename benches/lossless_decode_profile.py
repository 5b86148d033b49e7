"""One lossless decode of 256 MB of bfloat16 weights (N(0, 0.02)) on the GPU, for a profiler:

    ncu --kernel-name regex:lossless_decode --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats \\
        python benches/lossless_decode_profile.py

Decodes three times (the first compiles the kernels) and checks the result bit for bit.
"""

import torch

import cfc
from cfc.codec import _decompress_cuda


def main():
    x = (torch.randn(1 << 27) * 0.02).to(torch.bfloat16)
    c = cfc.compress(x, lossless=True)
    info = c.info
    frame = torch.frombuffer(bytearray(bytes(c)), dtype=torch.uint8).cuda()
    for _ in range(3):
        y = _decompress_cuda(frame, info["numel"], info["dtype"], tuple(info["shape"]), 1, codec="lossless")
    torch.cuda.synchronize()
    assert torch.equal(y.cpu().view(torch.int16), x.view(torch.int16)), "decode differs"
    print("decoded", info["numel"], "bfloat16 values bit for bit")


if __name__ == "__main__":
    main()
