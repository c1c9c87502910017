"""The reference trainer: a small training loop that uses the engine as a real trainer does.

``python -m trainer --algorithm grpo --iterations 20`` (see ``trainer.cli``) starts the
embedded stack (Redis, the student's tinylm server, scheduler, evaluator workers, finalizer,
weight syncer, and for teacher algorithms the teacher's server and a capture worker), then
per iteration: requests a training rollout with the trainer client, waits for its
``RolloutReady``, loads and collates the samples, computes the student's logprobs on the
sampled tokens with torch, takes an optimizer step on the lane's loss (``engine.losses``),
saves the new weights as a Hugging Face folder and publishes them as the next policy version
(``publish_version``, then ``wait_version_active``: ``trainer.publish``) before the next
request.

It is a reference, not a production trainer: one process, CPU, one optimizer step per
rollout. The engine never imports it; it imports only the engine's public surface (the
client, ``collate``, the losses) and the demo's process helpers to start the stack.

Modules: ``cli`` (the command), ``loop`` (the iterations), ``policy`` (the torch model),
``publish`` (saving and publishing weights), ``stack`` (the processes), ``report`` (metrics
and the plot).
"""
