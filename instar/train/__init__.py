"""The trainer: HF models sharded with FSDP2 over gloo (CPU) or NCCL (GPU) with the same code.

  model        load HF checkpoints (or NVIDIA AutoModel), the critic's value model, packed logprobs
  parallel     process group, device mesh, apply_fsdp (the only place that knows about sharding)
  batch        token-budget micro-batches (bin-packed rows) and the [B, T] views the losses see
  worker       TrainWorker: one rank (logprobs, values, train/critic steps, sync, save, export)
  weight_sync  bucketed broadcast of full weights from trainer rank 0 to the engines
  checkpoint   atomic sharded checkpoints (DCP) with scheduler, RNG and the caller's extra state
  run_dir      one run per output directory; crash-safe rewrites of its ledger and dumps on resume
  moe          routing replay (R3) and frozen routers, as hooks on the HF router modules
  optim        AdamW and the warm-up + decay schedule
  sft          `instar sft`
  launch       run N ranks as local processes (no Ray)
"""
