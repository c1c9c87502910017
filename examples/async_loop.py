"""A training loop with async refill, against the embedded demo stack, on CPU.

    python examples/async_loop.py [--iterations 3] [--workdir runs/async-loop]

It starts the demo's stack (``engine.ops.demo.start_stack``: Redis, the tinylm policy server,
a scheduler, evaluator workers, a finalizer and the weight syncer), then trains the tiny
model with a few policy-gradient steps:

1. ``RefillLoop(client, ahead=1)`` requests rollout N+1 before it hands the trainer rollout N,
   so the engine generates N+1 while the trainer trains on N;
2. the trainer collates N, takes one optimizer step on it (REINFORCE with the group-mean
   baseline: ``-(reward - mean) * logprob`` over the sampled tokens), and saves the model with
   ``save_pretrained`` into a new folder;
3. ``loop.publish(version, folder)`` appends ``PolicyVersionPublished``; the syncer quiesces the
   engine, loads the folder on the model server (``/update_weights_from_disk``) and resumes.
   Rollout N+1's trajectories pick the new weights up at their next turn: the line printed
   per iteration shows how many sampled tokens came from each version. The first rollouts
   run on the model the server started from, version 0: the demo starts tinylm without
   ``--weight-version`` and each worker labels it version 0 before it serves
   (``engine/backends/health.py``), so no token comes out of an unknown version.

Everything runs on the CPU; the first run builds the tiny model (``--train-steps`` sets how
long that takes). Ctrl-C stops every process the stack started.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.client import RefillLoop, RolloutClient, collate  # noqa: E402
from engine.ops import demo  # noqa: E402
from workers.cli import ROLLOUT  # noqa: E402


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               batch: dict[str, torch.Tensor], group: int) -> float:
    """One REINFORCE step on a collated batch; returns the loss."""
    tokens, mask = batch["tokens"], batch["loss_mask"]
    rewards = batch["rewards"].view(-1, group)
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)).view(-1, 1)
    logits = model(input_ids=tokens, attention_mask=batch["attention_mask"]).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    taken = logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    weights = mask[:, 1:]
    loss = -(advantages * taken * weights).sum() / weights.sum().clamp(min=1.0)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


async def train(stack: demo.Stack, iterations: int, prompts: int, group: int) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    base = stack.workdir / "tinylm"
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    async with RolloutClient.connect(stack.trainer_url) as client:
        loop = RefillLoop(client, ahead=1, n_prompts=prompts, n_samples_per_prompt=group,
                          datasets=["math_train"], timeout=900)
        async for it in loop.iterations(iterations):
            batch = collate(it.samples)
            loss = train_step(model, optimizer, batch, group)
            version = loop.version + 1
            out = stack.workdir / "weights" / f"v{version}"
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(base, out)  # tokenizer and chat template beside the weights
            model.save_pretrained(out)
            await loop.publish(version, str(out))
            spread = ", ".join(
                f"{'unknown' if v == '-1' else 'v' + v}: {n}"
                for v, n in sorted(it.ready.version_tokens.items(), key=lambda kv: int(kv[0]))
            )
            print(f"iteration {it.iteration}: {len(it.samples)} samples, mean reward "
                  f"{float(batch['rewards'].mean()):.2f}, loss {loss:.4f}, sampled tokens by "
                  f"version [{spread}] -> published v{version}", flush=True)
        active = await client.wait_version_active(loop.version, timeout=300)
        print(f"version {active.version} active on {', '.join(active.servers)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python examples/async_loop.py")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples-per-prompt", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("runs/async-loop"))
    parser.add_argument("--train-steps", type=int, default=None,
                        help="tinylm training steps when the model is first built")
    args = parser.parse_args()
    stack_args = demo.build_parser().parse_args(
        ["--workdir", str(args.workdir), "--workers", "2"]
        + (["--train-steps", str(args.train_steps)] if args.train_steps is not None else [])
    )
    stack = demo.start_stack(stack_args, rollout=ROLLOUT)
    try:
        asyncio.run(train(stack, args.iterations, args.prompts, args.samples_per_prompt))
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
