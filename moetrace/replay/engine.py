"""Replay recorded routing against a plan: per-rank tokens, slots touched, dispatch bytes
and predicted layer time for every (step, layer), vectorized over steps and layers.

Inputs are dense arrays ``load [T, L, E]`` (tokens per logical expert) read from the
store in step chunks (:func:`iter_load`), optionally ``slot_load [T, L, S]`` when the
engine counted per physical slot (replaying the recorded plan then uses those counts, so
it reproduces the recorded per-rank loads exactly), or per-token routing (exact dispatch
bytes). Splits of an expert's tokens over its replicas:

- ``even``: an equal share to every copy (fractional tokens);
- ``hash``: vLLM's per-token choice; per token ``replica = hash(token) mod copies`` with
  per-token data, else the integer split it converges to (floor, remainder to the first
  copies);
- ``local``: SGLang's static dispatch, a copy on the token's own rank, else on its node,
  else the hash choice. Needs per-token routing (source ranks); without it ``even``.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import InputError
from .cost import CostModel
from .planners import Plan, PlanShape, contiguous

SPLITS = ("even", "hash", "local")


def blas_single_thread():
    """One BLAS thread for the many small per-layer matmuls: OpenBLAS's thread pool costs
    more than it gives on [steps, experts] x [experts, ranks] products (10x slower on a
    busy 2-core machine). Uses threadpoolctl when installed (extra ``fast``)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")
_HASH = np.uint64(2654435761)


@dataclass
class RunShape:
    num_experts: int
    num_ranks: int
    ranks_per_node: int
    num_slots: int
    num_groups: int
    top_k: int
    hidden: int
    dtype_bytes: int
    expert_bytes: int
    layers: np.ndarray
    steps: np.ndarray
    has_slot: bool
    has_routing: bool
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_per_token(self) -> int:
        return self.hidden * self.dtype_bytes

    def plan_shape(self, ranks=None, replicas=None, groups=None, nodes=None, rpn=None) -> PlanShape:
        R = ranks or self.num_ranks
        rpn = rpn or min(self.ranks_per_node, R)
        S = self.num_experts + replicas if replicas is not None else (
            self.num_slots if ranks is None else self.num_experts)
        return PlanShape(R, rpn, S, groups or self.num_groups, nodes)

    @classmethod
    def from_store(cls, store, run_id: str) -> "RunShape":
        run = store.run(run_id)
        notes = []
        st = store.sql("""SELECT min(step) lo, max(step) hi, max(expert) me, count(slot) ns, max(slot) ms
                          FROM expert_load WHERE run_id = ?""", [run_id]).row(0, named=True)
        if st["lo"] is None:
            raise InputError(None, f"run {run_id!r} has no expert_load rows to replay")
        steps = store.sql("SELECT DISTINCT step FROM expert_load WHERE run_id = ? ORDER BY step", [run_id])["step"].to_numpy()
        layers = store.sql("SELECT DISTINCT layer FROM expert_load WHERE run_id = ? ORDER BY layer", [run_id])["layer"].to_numpy()
        E = run.get("num_experts") or int(st["me"]) + 1
        R = run.get("num_ranks")
        if not R:
            R = 1
            notes.append("runs.num_ranks unknown: 1 rank assumed")
        rpn = run.get("ranks_per_node") or R
        S = run.get("num_slots") or max(E, (int(st["ms"]) + 1) if st["ms"] is not None else E)
        G = run.get("num_groups") or 1
        k = run.get("top_k") or 8
        hidden = run.get("hidden")
        if not hidden:
            hidden = 7168
            notes.append("runs.hidden unknown: 7168 assumed for dispatch bytes")
        db = run.get("dtype_bytes") or 2
        eb = run.get("expert_bytes") or 3 * hidden * 2048
        if not run.get("expert_bytes"):
            notes.append(f"runs.expert_bytes unknown: 3 x hidden x 2048 = {eb} bytes per expert assumed")
        has_routing = store.has_files("routing") and store.sql(
            "SELECT count(*) n FROM (SELECT 1 FROM routing WHERE run_id = ? LIMIT 1)", [run_id])["n"][0] > 0
        return cls(int(E), int(R), int(rpn), int(S), int(G), int(k), int(hidden), int(db), int(eb),
                   layers.astype(np.int64), steps.astype(np.int64), bool(st["ns"]), bool(has_routing), notes)


def plan_from_rows(df, plan_id: str, num_experts: int) -> Plan:
    """A Plan from placement rows (layer, slot, rank, node, expert) of one plan."""
    if df.height == 0:
        raise InputError(None, f"no placement rows for plan {plan_id!r}")
    layers = np.unique(df["layer"].to_numpy())
    S = int(df["slot"].max()) + 1
    L = layers.size
    p2l = np.full((L, S), -1, np.int64)
    li = np.searchsorted(layers, df["layer"].to_numpy())
    p2l[li, df["slot"].to_numpy()] = df["expert"].to_numpy()
    if (p2l < 0).any():
        raise InputError(None, f"plan {plan_id!r}: some (layer, slot) have no expert")
    rank_of = np.zeros(S, np.int64)
    rank_of[df["slot"].to_numpy()] = df["rank"].to_numpy()
    R = int(rank_of.max()) + 1
    if S % R or not np.array_equal(rank_of, np.arange(S) // (S // R)):
        raise InputError(None, f"plan {plan_id!r}: slots are not laid out as slot // slots_per_rank")
    node_of = np.zeros(R, np.int64)
    node_of[df["rank"].to_numpy()] = df["node"].to_numpy()
    nn = int(node_of.max()) + 1
    rpn = R // nn if R % nn == 0 else R
    return Plan(p2l, max(num_experts, int(p2l.max()) + 1), R, rpn, layers=layers, policy="stored", plan_id=plan_id)


def load_plan(store, run_id: str, plan_id: str, shape: RunShape) -> Plan:
    if plan_id == "recorded":
        return recorded_plan(store, run_id, shape)
    df = store.sql("SELECT layer, slot, rank, node, expert FROM placement WHERE run_id = ? AND plan_id = ?",
                   [run_id, plan_id])
    if df.height == 0:
        ids = store.sql("SELECT DISTINCT plan_id FROM placement WHERE run_id = ?", [run_id])["plan_id"].to_list()
        raise InputError(None, f"run {run_id!r} has no plan {plan_id!r} (plans: {', '.join(ids) or 'none'})")
    return align_layers(plan_from_rows(df, plan_id, shape.num_experts), shape.layers)


def recorded_plan(store, run_id: str, shape: RunShape) -> Plan:
    """The run's own placement (plan_id 'recorded'), else contiguous (slot = expert)."""
    df = store.sql("SELECT layer, slot, rank, node, expert FROM placement WHERE run_id = ? AND plan_id = 'recorded'",
                   [run_id]) if store.has_files("placement") else None
    if df is not None and df.height:
        p = align_layers(plan_from_rows(df, "recorded", shape.num_experts), shape.layers)
        p.policy = "recorded"
        return p
    L = shape.layers.size
    p = contiguous(np.zeros((L, shape.num_experts)), PlanShape(shape.num_ranks, shape.ranks_per_node, shape.num_slots))
    p.layers, p.plan_id, p.policy = shape.layers, "recorded", "recorded (contiguous assumed)"
    return p


def align_layers(plan: Plan, layers: np.ndarray) -> Plan:
    """Rows of ``plan`` for ``layers`` (the layers present in the load)."""
    if plan.num_layers == len(layers) and np.array_equal(plan.layers, layers):
        return plan
    idx = []
    for l in layers:
        hit = np.flatnonzero(plan.layers == l)
        if not hit.size:
            raise InputError(None, f"plan {plan.plan_id!r} has no row for layer {int(l)}")
        idx.append(int(hit[0]))
    return Plan(plan.phy2log[idx], plan.num_experts, plan.num_ranks, plan.ranks_per_node,
                layers=np.asarray(layers), policy=plan.policy, plan_id=plan.plan_id, params=plan.params)


# ----------------------------------------------------------------------------- reading
def iter_load(store, run_id: str, shape: RunShape, chunk_steps: int = 2000,
              with_slots: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Yield (step ids [t], load [t, L, E] float32, slot_load [t, L, S] or None) by step chunks."""
    steps, layers, E, S = shape.steps, shape.layers, shape.num_experts, shape.num_slots
    want_slots = with_slots and shape.has_slot
    cols = "step, layer, expert, tokens" + (", slot" if want_slots else "")
    for i in range(0, steps.size, chunk_steps):
        ids = steps[i:i + chunk_steps]
        tbl = store.arrow(f"SELECT {cols} FROM expert_load WHERE run_id = ? AND step BETWEEN ? AND ?",
                          [run_id, int(ids[0]), int(ids[-1])])
        ti = np.searchsorted(ids, tbl.column("step").to_numpy())
        li = np.searchsorted(layers, tbl.column("layer").to_numpy())
        cell = ti * layers.size + li
        tok = tbl.column("tokens").to_numpy().astype(np.float64)
        n = ids.size * layers.size
        ex = tbl.column("expert").to_numpy()
        if ex.size and (ex.min() < 0 or ex.max() >= E):
            raise InputError(None, f"run {run_id!r}: expert_load holds expert {int(ex.max())} but the run has {E} experts")
        # bincount sums rows that repeat a (step, layer, expert): per slot, per source rank
        load = np.bincount(cell * E + ex, weights=tok,
                           minlength=n * E).astype(np.float32).reshape(ids.size, layers.size, E)
        slot_load = None
        if want_slots:
            sl = tbl.column("slot").to_numpy(zero_copy_only=False).astype(np.float64)
            ok = ~np.isnan(sl)
            if ok.any() and (sl[ok].min() < 0 or sl[ok].max() >= S):
                raise InputError(None, f"run {run_id!r}: expert_load holds slot {int(sl[ok].max())} but the run has {S} slots")
            slot_load = np.bincount(cell[ok] * S + sl[ok].astype(np.int64), weights=tok[ok],
                                    minlength=n * S).astype(np.float32).reshape(ids.size, layers.size, S)
        yield ids, load, slot_load


def read_load(store, run_id: str, shape: RunShape, step_range: tuple[int, int] | None = None,
              max_steps: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(step ids, load [T, L, E]) for all steps (or steps lo <= step < hi; at most max_steps)."""
    steps = shape.steps
    if step_range:
        steps = steps[(steps >= step_range[0]) & (steps < step_range[1])]
    if max_steps is not None:
        steps = steps[:max_steps]
    if steps.size == 0:
        return steps, np.zeros((0, shape.layers.size, shape.num_experts), np.float32)
    parts = [(ids, ld) for ids, ld, _ in iter_load(store, run_id, replace(shape, steps=steps))]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


# ----------------------------------------------------------------------------- replay core
@dataclass
class Block:
    """Replay of t steps: everything [t, L, R] unless said otherwise."""
    tokens: np.ndarray
    touched: np.ndarray
    bytes_intra: np.ndarray
    bytes_inter: np.ndarray
    exact_bytes: bool
    nodes_per_token_max: int | None = None
    nodes_per_token_mean: float | None = None


def _slot_replica_index(plan: Plan) -> np.ndarray:
    """Replica number of every slot among the slots of its expert, [L, S]."""
    L, S = plan.phy2log.shape
    out = np.zeros((L, S), np.int64)
    for li in range(L):
        order = np.argsort(plan.phy2log[li], kind="stable")
        sorted_e = plan.phy2log[li][order]
        first = np.searchsorted(sorted_e, sorted_e)
        out[li, order] = np.arange(S) - first
    return out


def _per_layer_matmul(a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """out[t, l, :] = a[t, l, :] @ m[l] for a [T, L, E] and m [L, E, R] (BLAS per layer)."""
    T, L, _ = a.shape
    out = np.empty((T, L, m.shape[2]), np.result_type(a, m))
    for li in range(L):
        np.matmul(a[:, li, :], m[li], out=out[:, li, :])
    return out


def estimate_dispatch(load: np.ndarray, plan: Plan, top_k: int, bytes_per_token: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each rank receives in the dispatch, without per-token data: a token reaches
    rank r unless it misses every copy there, each copy taking load/copies of the step's
    B tokens independently, P = 1 - prod(1 - x/B); source ranks uniform over ranks (the
    token's own rank costs nothing, its node's other ranks are intra-node)."""
    T, L, E = load.shape
    B = load.sum(axis=2, keepdims=True, dtype=np.float32) / np.float32(max(top_k, 1))
    inv = np.float32(1.0) / (plan.logcnt().astype(np.float32)[None] * np.maximum(B, np.float32(1e-30)))
    x = np.multiply(load, inv, dtype=np.float32)
    np.clip(x, 0.0, 1.0 - 1e-7, out=x)
    np.negative(x, out=x)
    np.log1p(x, out=x)                 # log(1 - x), x = copy load / tokens per step
    s = _per_layer_matmul(x, plan.copies().astype(np.float32))
    recv = B * (1.0 - np.exp(s))
    R, rpn = plan.num_ranks, plan.ranks_per_node
    intra = recv * ((rpn - 1) / R) * bytes_per_token
    inter = recv * ((R - rpn) / R) * bytes_per_token
    return intra, inter


def replay_load(load: np.ndarray, plan: Plan, split: str = "even", slot_load: np.ndarray | None = None,
                top_k: int = 8, bytes_per_token: int = 14336) -> Block:
    """Replay aggregated load [t, L, E] (or per-slot counts of this very plan) against ``plan``."""
    with blas_single_thread():
        return _replay_load(load, plan, split, slot_load, top_k, bytes_per_token)


def _replay_load(load, plan, split, slot_load, top_k, bytes_per_token) -> Block:
    T, L, E = load.shape
    R, spr = plan.num_ranks, plan.slots_per_rank
    if slot_load is not None:
        if slot_load.shape[2] != plan.num_slots:
            raise InputError(None, f"per-slot load has {slot_load.shape[2]} slots, plan has {plan.num_slots}")
        st = slot_load.reshape(T, L, R, spr)
        tokens = st.sum(axis=3, dtype=np.float64)
        touched = (st > 0).sum(axis=3)
    elif split == "hash":
        cnt = plan.logcnt()
        rep = _slot_replica_index(plan)
        g = np.take_along_axis(load, np.broadcast_to(plan.phy2log[None], (T, L, plan.num_slots)), axis=2)
        c = np.take_along_axis(cnt, plan.phy2log, axis=1)[None].astype(np.float32)
        st = np.floor(g / c) + (rep[None] < np.mod(g, c))
        st = st.reshape(T, L, R, spr)
        tokens = st.sum(axis=3, dtype=np.float64)
        touched = (st > 0).sum(axis=3)
    else:
        tokens = _per_layer_matmul(load.astype(np.float32, copy=False), plan.share().astype(np.float32))
        touched = _per_layer_matmul((load > 0).astype(np.float32), plan.copies().astype(np.float32))
    intra, inter = estimate_dispatch(load, plan, top_k, bytes_per_token)
    return Block(tokens, touched, intra, inter, exact_bytes=False)


def replay_routing(step_idx, layer_idx, token, src_rank, expert, T: int, plan: Plan, split: str,
                   bytes_per_token: int, recorded_slot=None) -> Block:
    """Exact replay of per-token routing rows (index arrays) against ``plan``: each token
    goes once to each distinct destination rank; bytes received per rank, intra vs inter
    node; a token staying on its own rank moves nothing. ``recorded_slot`` (the physical
    slot each row went to, when the engine recorded it and ``plan`` is the plan it ran)
    replaces the replica choice."""
    L, R, spr, rpn = plan.num_layers, plan.num_ranks, plan.slots_per_rank, plan.ranks_per_node
    E = plan.num_experts
    ti = np.asarray(step_idx, np.int64)
    li = np.asarray(layer_idx, np.int64)
    tok = np.asarray(token, np.int64)
    src = np.asarray(src_rank, np.int64)
    e = np.asarray(expert, np.int64)
    cnt = plan.logcnt()
    maxc = int(cnt.max())
    log2phy = np.full((L, E, maxc), -1, np.int64)
    rep = _slot_replica_index(plan)
    for l in range(L):
        log2phy[l, plan.phy2log[l], rep[l]] = np.arange(plan.num_slots)
    h = (tok.astype(np.uint64) * _HASH) % np.uint64(1 << 32)
    slot = log2phy[li, e, (h % cnt[li, e].astype(np.uint64)).astype(np.int64)]
    if split == "local":
        on_rank = np.full((L, E, R), -1, np.int64)
        on_node = np.full((L, E, plan.num_nodes), -1, np.int64)
        srank, snode = plan.slot_rank, plan.slot_node
        for l in range(L):
            for s in range(plan.num_slots - 1, -1, -1):   # lowest slot wins
                on_rank[l, plan.phy2log[l, s], srank[s]] = s
                on_node[l, plan.phy2log[l, s], snode[s]] = s
        src_ok = np.clip(src, 0, R - 1)
        a = on_rank[li, e, src_ok]
        b = on_node[li, e, src_ok // rpn]
        slot = np.where(a >= 0, a, np.where(b >= 0, b, slot))
    if recorded_slot is not None:
        rs = np.asarray(recorded_slot, np.int64)
        if rs.size and (rs.max() >= plan.num_slots or (rs >= 0).sum() != rs.size
                        or (plan.phy2log[li, np.maximum(rs, 0)] != e).any()):
            raise InputError(None, "recorded routing slots do not match the plan's experts")
        slot = rs
    dst = slot // spr
    tl = ti * L + li
    cells = T * L
    tokens = np.bincount(tl * R + dst, minlength=cells * R).reshape(T, L, R).astype(np.float64)
    hit = np.zeros((cells, plan.num_slots), bool)
    hit[tl, slot] = True
    touched = hit.reshape(T, L, R, spr).sum(axis=3)
    # dense (cell, token) x destination-rank marks: a token goes once to each distinct rank
    maxtok = int(tok.max()) + 1 if tok.size else 1
    row = tl * maxtok + tok
    marks = np.zeros((cells * maxtok, R), bool)
    marks[row, dst] = True
    src_of = np.full(cells * maxtok, -1, np.int64)
    src_of[row] = src
    nz_row, d = np.nonzero(marks)
    s = src_of[nz_row]
    cell = nz_row // maxtok
    remote = s != d
    same_node = (s // rpn) == (d // rpn)
    w_intra = (remote & same_node).astype(np.float64) * bytes_per_token
    w_inter = (remote & ~same_node).astype(np.float64) * bytes_per_token
    intra = np.bincount(cell * R + d, weights=w_intra, minlength=cells * R).reshape(T, L, R)
    inter = np.bincount(cell * R + d, weights=w_inter, minlength=cells * R).reshape(T, L, R)
    # nodes per token (node-limited routing shows as a small maximum)
    nn = plan.num_nodes
    used = src_of >= 0
    if R % rpn == 0:
        per_tok = marks[used].reshape(-1, nn, rpn).any(axis=2).sum(axis=1)
    else:
        per_tok = np.array([len(set((np.flatnonzero(m) // rpn).tolist())) for m in marks[used]])
    return Block(tokens, touched, intra, inter, exact_bytes=True,
                 nodes_per_token_max=int(per_tok.max()) if per_tok.size else 0,
                 nodes_per_token_mean=float(per_tok.mean()) if per_tok.size else 0.0)


# ----------------------------------------------------------------------------- metrics
@dataclass
class LayerMetrics:
    """Per (step, layer) results, [t, L] each; rank times [t, L, R]."""
    max_tokens: np.ndarray
    mean_tokens: np.ndarray
    imbalance: np.ndarray
    straggler: np.ndarray
    layer_ns: np.ndarray
    dispatch_ns: np.ndarray
    compute_ns: np.ndarray
    rank_ns: np.ndarray


def layer_metrics(block: Block, cost: CostModel) -> LayerMetrics:
    tok = block.tokens
    mx = tok.max(axis=2)
    mean = tok.mean(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        imb = np.where(mean > 0, mx / np.where(mean > 0, mean, 1), 1.0)
    disp, comp, comb = cost.rank_ns(tok, block.touched, block.bytes_intra, block.bytes_inter)
    rank_ns = disp + comp + comb
    return LayerMetrics(mx, mean, imb, np.argmax(rank_ns, axis=2), rank_ns.max(axis=2), disp, comp, rank_ns)


def summarize(imbalance: np.ndarray, layer_ns: np.ndarray, rank_ns_mean: np.ndarray | None = None) -> dict:
    """Summary over (step, layer): mean / p99 imbalance, mean predicted MoE time per step."""
    imb = imbalance.ravel()
    out = {"mean_imbalance": float(imb.mean()) if imb.size else None,
           "p99_imbalance": float(np.percentile(imb, 99)) if imb.size else None,
           "max_imbalance": float(imb.max()) if imb.size else None,
           "predicted_step_ns": int(layer_ns.sum(axis=1).mean()) if layer_ns.size else None}
    if rank_ns_mean is not None and layer_ns.size:
        with np.errstate(divide="ignore", invalid="ignore"):
            eff = np.where(layer_ns > 0, rank_ns_mean / layer_ns, 1.0)
        out["mean_efficiency"] = float(eff.mean())
    return out


def approximation_notes(block: Block, split: str, used_slots: bool, has_routing: bool) -> list[str]:
    notes = []
    if used_slots:
        notes.append("per-rank tokens from the recorded per-slot counts (exact)")
    if not block.exact_bytes:
        notes.append("no per-token routing: dispatch bytes estimated (a token reaches a rank with probability "
                     "1 - prod over the rank's copies of (1 - copy load / tokens per step), source ranks uniform)")
    if split == "local" and not has_routing:
        notes.append("--split local needs per-token source ranks: even split used")
    if split == "hash" and not has_routing and not used_slots:
        notes.append("--split hash without per-token data: integer split (floor, remainder to the first copies)")
    return notes


def params_json(**kw) -> str:
    return json.dumps(kw, sort_keys=True, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
