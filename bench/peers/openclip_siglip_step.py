"""OpenCLIP's training step with its sigmoid loss (`SigLipLoss`) on one GPU: the peer of our `loss=siglip` step.

    python bench/peers/openclip_siglip_step.py --model ViT-B-16 --batch 1024 [--steps 30] [--json out.json]
    python bench/throughput.py --model vit_b16 --batch 1024 --set "loss=siglip" \
        --peer bench/peers/openclip_siglip_step.py

The same measurement as the CLIP peer (`openclip_step.py`, which throughput.py's `--peer` runs by default): forward
+ loss + backward + fused AdamW under bf16 autocast on random on-device inputs, CUDA events, median over --steps
after 5 warm-up steps, FLOPs from FlopCounterMode. Only the model (built with OpenCLIP's SigLIP initial values,
init_logit_scale=ln 10 and init_logit_bias=-10, so its forward returns the bias) and the loss differ. Takes the
arguments throughput.py passes to a peer.
"""
import argparse
import json
import math

import torch


def bench(fn, iters, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main():
    import open_clip
    from open_clip.loss import SigLipLoss
    from torch.utils.flop_counter import FlopCounterMode

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ViT-B-16")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    model = open_clip.create_model(args.model, init_logit_scale=math.log(10), init_logit_bias=-10.0).cuda()
    loss_fn = SigLipLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.2, fused=True)
    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    images = torch.randn(args.batch, 3, size, size, device="cuda")
    tokens = torch.randint(0, 49408, (args.batch, 77), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            image_features, text_features, logit_scale, logit_bias = model(images, tokens)
            loss = loss_fn(image_features, text_features, logit_scale, logit_bias)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as counter:
        step()
    seconds = bench(step, args.steps)
    result = {
        "impl": "open_clip " + open_clip.__version__,
        "loss": "siglip",
        "model": args.model,
        "batch": args.batch,
        "samples_per_s": args.batch / seconds,
        "step_ms": seconds * 1e3,
        "tflops": counter.get_total_flops() / seconds / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
