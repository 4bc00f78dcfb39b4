"""The PyTorch peer row of gpu_suite.py: Hugging Face's GPT-2 under torch.autocast(bfloat16) and
torch.compile, with the same shape, batch, optimizer and loss as the JAX rows.

AdamW (lr 1e-4, fused=True on a GPU: what a torch.compile user runs), SDPA attention, the loss
as `F.cross_entropy` on the float32-cast logits. On a CPU (the dry run) autocast runs bf16 too.
"""

from __future__ import annotations

import statistics
import time


def row(args, timed) -> dict:
    import gpt2_variants
    import torch
    import torch.nn.functional as F
    from transformers import GPT2LMHeadModel

    shape = gpt2_variants.QUICK if args.quick else gpt2_variants.GPT2
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    config = gpt2_variants.hf_config(shape, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=gpt2_variants.LR, fused=cuda)
    tokens = torch.randint(0, shape["vocab"] // 2, (args.batch, shape["seq"] + 1), device=device)

    def loss_of(inputs, targets):
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(inputs).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    compiled = torch.compile(loss_of)

    def step():
        loss = compiled(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    started = time.perf_counter()
    step()  # compiles
    if cuda:
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - started
    losses = []

    def run(wait):
        loss = step()
        if wait:
            losses.append(float(loss))  # synchronises

    times = timed(run, args.lock, args.steps, args.blocks, args.warmup)
    seconds = statistics.median(times)
    params = sum(p.numel() for p in model.parameters())
    flops = gpt2_variants.model_flops(params, shape, args.batch)
    return {
        "step_ms": seconds * 1e3,
        "tokens_per_s": args.batch * shape["seq"] / seconds,
        "mfu": flops / seconds / (989.4e12),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "compile_s": compile_s,
        "loss_first_last": [losses[0], losses[-1]],
        "params": params,
        "torch": torch.__version__,
    }
