"""``moetrace cost``: the GPU cost model as a calculator (expert MLP time, dispatch and
combine time, each with the band measured on published kernel rows)."""
from __future__ import annotations

import json
import math

import click

from ..errors import UsageError
from ._options import hardware_option, kernel_options


def _num(name: str, text, integer: bool = True):
    """A positive finite number from the command line (one-line error otherwise)."""
    if text is None:
        return None
    try:
        v = float(text)
    except ValueError:
        raise UsageError(f"--{name} must be a positive {'integer' if integer else 'number'}, got {text!r}") from None
    if not math.isfinite(v) or v <= 0 or (integer and v != int(v)):
        raise UsageError(f"--{name} must be a positive {'integer' if integer else 'number'}, got {text!r}")
    return int(v) if integer else v


def _table(rows) -> str:
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


@click.command("cost")
@hardware_option(help="GPU whose published kernel measurements the model uses.", required=True)
@click.option("--hidden", required=True, help="Model hidden size.")
@click.option("--intermediate", default=None, help="Expert intermediate size (expert MLP mode).")
@click.option("--weight-dtype", default="fp8", show_default=True, type=click.Choice(["fp8", "bf16", "fp4"]),
              help="Expert weight dtype (FP4 only where the GPU has FP4 tensor math).")
@click.option("--experts", default=None, help="Experts touched on the rank (expert MLP mode).")
@click.option("--tokens-per-expert", default=None, help="Tokens each touched expert receives: one number, or one per expert "
                   "(comma-separated) (expert MLP mode).")
@click.option("--ep", default=None, help="Expert-parallel size (all-to-all mode).")
@click.option("--ranks-per-node", default=None, help="GPUs per NVLink domain (all-to-all mode; default the GPU's: 8 "
                                                       "on an HGX node, 72 on GB200 NVL72).")
@click.option("--tokens", default=None, help="Tokens per rank (all-to-all mode).")
@click.option("--top-k", default="8", show_default=True, help="Experts per token (all-to-all mode).")
@click.option("--num-experts", default="256", show_default=True, help="Routed experts in the model (normal kernels' "
                                                                      "deduplication).")
@kernel_options(kernel_help="all-to-all mode")
@click.option("--dispatch-dtype", default="fp8", show_default=True, type=click.Choice(["fp8", "bf16"]))
@click.option("--combine-dtype", default="bf16", show_default=True, type=click.Choice(["fp8", "bf16"]))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every term, the band and its source).")
def cost(hardware, hidden, intermediate, weight_dtype, experts, tokens_per_expert, ep, ranks_per_node, tokens, top_k,
         num_experts, kernel, sms, max_nodes_per_token, dispatch_dtype, combine_dtype, as_json):
    """Predicted GPU time of an expert MLP or of a dispatch/combine, with its measured band.

    Expert MLP mode (--intermediate, --experts, --tokens-per-expert): all touched experts'
    gate/up and down grouped GEMMs on one rank. All-to-all mode (--ep, --tokens, --kernel):
    one rank's dispatch and combine. The model and its bands come from published DeepGEMM and
    DeepEP kernel measurements; every answer says whether its band was validated on that
    GPU and kernel (docs/calibration.md, "GPU cost model").

    Example:

        moetrace cost --hardware H800 --hidden 7168 --intermediate 2048 --weight-dtype fp8 --experts 4 --tokens-per-expert 256 --json

        moetrace cost --hardware H800 --hidden 7168 --ep 32 --ranks-per-node 8 --tokens 128 --top-k 8 --kernel low-latency
    """
    from .. import costmodel

    hidden_v = _num("hidden", hidden)
    expert_mode = any(v is not None for v in (intermediate, experts, tokens_per_expert))
    comm_mode = any(v is not None for v in (ep, tokens, kernel))
    if not expert_mode and not comm_mode:
        raise UsageError("give --intermediate/--experts/--tokens-per-expert (expert MLP) or --ep/--tokens/--kernel "
                         "(all-to-all)")
    out: dict = {}
    rows = []
    if expert_mode:
        missing = [n for n, v in (("intermediate", intermediate), ("experts", experts),
                                  ("tokens-per-expert", tokens_per_expert)) if v is None]
        if missing:
            raise UsageError(f"expert MLP mode needs --{', --'.join(missing)}")
        e = _num("experts", experts)
        ms = [_num("tokens-per-expert", t.strip()) for t in str(tokens_per_expert).split(",")]
        if len(ms) == 1:
            ms = ms * e
        elif len(ms) != e:
            raise UsageError(f"--tokens-per-expert has {len(ms)} values for --experts {e} (give one, or one per expert)")
        r = costmodel.expert_ns(hardware, hidden_v, _num("intermediate", intermediate), ms, weight_dtype)
        out.update(r)
        t = r["terms"]
        rows += [("expert_ns", f"{r['expert_ns']:,.0f}  (±{r['expert_band']:.0%}, {r['validation']})"),
                 ("  gate/up GEMM ns", f"{t['gate_up']['time_ns']:,.0f}  (compute {t['gate_up']['compute_ns']:,.0f}, "
                                       f"memory {t['gate_up']['memory_ns']:,.0f}, {t['gate_up']['waves']} wave(s))"),
                 ("  down GEMM ns", f"{t['down']['time_ns']:,.0f}  (compute {t['down']['compute_ns']:,.0f}, "
                                    f"memory {t['down']['memory_ns']:,.0f}, {t['down']['waves']} wave(s))"),
                 ("expert band source", r["band_source"])]
    if comm_mode:
        if ep is None:
            raise UsageError("--kernel and --tokens need --ep (all-to-all mode)")
        if tokens is None or kernel is None:
            raise UsageError("all-to-all mode needs --tokens and --kernel")
        r = costmodel.comm_ns(hardware, hidden_v, _num("ep", ep), _num("ranks-per-node", ranks_per_node),
                              _num("tokens", tokens), _num("top-k", top_k), kernel, dispatch_dtype, combine_dtype,
                              num_experts=_num("num-experts", num_experts), topk_groups=max_nodes_per_token, sms=sms)
        band_source = r.pop("band_source")
        if expert_mode:
            out["comm_band_measured"] = r.pop("band_measured")
        source = r.pop("source")
        terms = r.pop("terms")
        if expert_mode:
            out["comm_band_source"], out["comm_source"], out["comm_terms"] = band_source, source, terms
            out.update(r)
        else:
            out.update(r, band_source=band_source, source=source, terms=terms)
        rows += [(f"dispatch_ns ({kernel})", f"{r['dispatch_ns']:,.0f}  (±{r['dispatch_band']:.0%}, {r['validation']}, "
                                             f"bottleneck {terms['dispatch']['bottleneck']})"),
                 (f"combine_ns ({kernel})", f"{r['combine_ns']:,.0f}  (±{r['combine_band']:.0%}, {r['validation']}, "
                                            f"bottleneck {terms['combine']['bottleneck']})"),
                 ("comm band source", band_source)]
    if as_json:
        click.echo(json.dumps(out, indent=1, sort_keys=True))
    else:
        click.echo(_table([("hardware", out["hardware"])] + rows))


def register(cli):
    cli.add_command(cost)
