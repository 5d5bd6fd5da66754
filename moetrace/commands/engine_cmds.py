"""Engine commands: live capture from a transformers model, the CPU reference run."""
from __future__ import annotations

import click

from ._options import int_list, rows_written

#: the CPU build of PyTorch, for the install line of the torch extra
CPU_TORCH = "(CPU-only build: pip install torch --index-url https://download.pytorch.org/whl/cpu)"


def _idle(ctx, param, values):
    out = []
    for v in values:
        try:
            s, r = v.split(":")
            out.append((int(s), int(r)))
        except ValueError:
            raise click.BadParameter(f"{v!r} is not STEP:RANK") from None
    return out


@click.command()
@click.argument("outdir", type=click.Path(file_okay=False))
@click.option("--ranks", default=2, show_default=True, help="Expert-parallel ranks (processes).")
@click.option("--experts", default=8, show_default=True, help="Logical experts per layer.")
@click.option("--top-k", default=2, show_default=True, help="Experts per token.")
@click.option("--layers", default=2, show_default=True, help="MoE layers.")
@click.option("--hidden", default=64, show_default=True, help="Hidden size.")
@click.option("--ffn", default=128, show_default=True, help="Expert intermediate size.")
@click.option("--steps", default=6, show_default=True, help="Steps (forward passes).")
@click.option("--tokens-per-rank", default=32, show_default=True, help="Tokens per rank per step.")
@click.option("--prefill-tokens", default=0, show_default=True, help="Step 0 is a prefill of this many tokens per rank.")
@click.option("--skew", default=1.0, show_default=True, help="Zipf exponent of the router's preference (0: none).")
@click.option("--hot", callback=int_list, default=None, help="Favoured experts, most favoured first (e.g. 5,2).")
@click.option("--placement", default="contiguous", show_default=True,
              help="contiguous, round_robin, reverse, random:SEED, or a JSON file [[layer][slot]] (more slots than "
                   "experts = replicas).")
@click.option("--idle", multiple=True, callback=_idle, help="STEP:RANK with no tokens (a dummy step); repeatable.")
@click.option("--seed", default=0, show_default=True, help="Seed of tokens and weights (same seed: same routing "
                                                           "under any placement).")
@click.option("--no-profile", is_flag=True, help="Do not run the PyTorch profiler.")
@click.option("--delay-rank", default=-1, show_default=True,
              help="Hold this rank's compute --delay-us per layer (a known cause for `moetrace waits`; -1: none).")
@click.option("--delay-us", default=0.0, show_default=True, help="Injected delay per layer, µs.")
@click.option("--delay-every", default=1, show_default=True,
              help="Inject the delay in every N-th step only (2: the other steps are a control run interleaved "
                   "with the delayed ones).")
@click.option("--micro-batches", type=click.IntRange(1, 2), default=1, show_default=True,
              help="2: two micro-batches per step, the all-to-all of one in flight while the other computes.")
@click.option("--repeats", default=1, show_default=True,
              help="Timed passes over all steps; per (step, layer, rank) the median and its spread are stored "
                   "(table cell_times). With more than 1 the profiler records an extra pass of its own.")
@click.option("--warmup", default=1, show_default=True, help="Untimed iterations of the first step before timing.")
@click.option("--threads-per-rank", default=1, show_default=True,
              help="Torch threads per rank process (1: one core per rank, the low-noise setting).")
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@click.option("--store", "store_path", type=click.Path(file_okay=False), default=None,
              help="Also ingest the output into this store.")
@click.option("--run-id", default=None, help="Run id when ingesting.")
def refrun(outdir, store_path, run_id, no_profile, quiet, **kw):
    """Run a real expert-parallel MoE on CPU (torch.distributed gloo, one process per
    rank, all_to_all_single dispatch and combine) with the PyTorch profiler on; write
    per-rank Kineto traces, the routing, the measured per-slot load and the steps.

    Example:

    \b
        moetrace refrun rr --ranks 4 --experts 16 --skew 1.2 --idle 3:2 --store st
    """
    from ..errors import require_extra

    require_extra("moetrace refrun", "torch", "torch", hint=CPU_TORCH)
    from ..produce.refrun import RefRunConfig, run

    cfg = RefRunConfig(profile=not no_profile, progress=not quiet, **kw)
    man = run(cfg, outdir)
    click.echo(f"{outdir}: {cfg.ranks} ranks x {cfg.steps} steps in {man['wall_s']:.1f} s "
               f"({len(man['files'])} files)")
    nz = man["noise"]
    pct = lambda v: "n/a (1 pass)" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    click.echo(f"noise over {nz['passes']} timed pass(es), median relative spread (p75-p25)/median per cell: "
               f"expert {pct(nz['expert_spread_p50'])}, MoE {pct(nz['moe_spread_p50'])}, "
               f"layer {pct(nz['layer_spread_p50'])}"
               + (f"; CPU basis: expert {pct(nz['expert_cpu_spread_p50'])}, layer {pct(nz['layer_cpu_spread_p50'])}"
                  if nz.get("expert_cpu_spread_p50") is not None else "")
               + ("; ranks oversubscribed the CPU cores"
                                                         if nz["oversubscribed"] else ""))
    if store_path:
        from ..collect import ingest

        def said(rd, res):
            click.echo(f"run {res.run_id}: " + (res.message if res.skipped else rows_written(res.rows, rd.run)))

        ingest(store_path, [outdir], run_id=run_id, on_write=said)


@click.command()
@click.argument("store", type=click.Path(file_okay=False))
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Prompt file: one prompt per line, or JSONL with 'prompt'.")
@click.option("--model", "model_path", default=None, help="transformers model folder (or hub id with --download).")
@click.option("--tiny", type=click.Choice(["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]), default=None,
              help="A tiny randomly initialized model of this architecture instead (no download).")
@click.option("--max-new-tokens", default=8, show_default=True, help="Decode steps after the prefill (0: prefill only).")
@click.option("--batch-size", default=8, show_default=True, help="Prompts per batch.")
@click.option("--download", is_flag=True, help="Allow downloading --model from the Hugging Face hub.")
@click.option("--seed", default=0, show_default=True, help="Seed (tiny models).")
@click.option("--run-id", default=None, help="Run id.")
def capture(store, prompts, model_path, tiny, max_new_tokens, batch_size, download, seed, run_id):
    """Capture per-token router decisions and gate weights of a transformers MoE model
    (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...) over a prompt file, greedy decoding;
    each forward pass is a step.

    Example:

    \b
        moetrace capture st --tiny qwen3_moe --prompts prompts.txt --max-new-tokens 4
    """
    from .. import open_store
    from ..errors import require_extra

    require_extra("moetrace capture", "capture", "torch", "transformers")
    from ..produce.capture import capture_prompts, load_model, read_prompts, tiny_model

    if bool(model_path) == bool(tiny):
        raise click.UsageError("give exactly one of --model and --tiny")
    texts = read_prompts(prompts)
    if tiny:
        model, tok, source = tiny_model(tiny, seed=seed), None, f"capture:tiny-{tiny}"
    else:
        (model, tok), source = load_model(model_path, download), f"capture:{model_path}"
    cap = capture_prompts(model, texts, tok, max_new_tokens=max_new_tokens, batch_size=batch_size,
                          progress=lambda line: click.echo(line, err=True))   # progress on stderr
    res = cap.write(open_store(store, create=True), run_id=run_id, source=source)
    click.echo(f"run {res.run_id} ({type(model).__name__}, {len(cap.routers)} MoE layers, {cap.step + 1} steps): "
               + rows_written(res.rows))


def register(cli):
    cli.add_command(refrun)
    cli.add_command(capture)
