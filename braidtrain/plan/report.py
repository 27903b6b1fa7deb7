"""The plan command's output: the ranked table, and each row as JSON."""

from __future__ import annotations

from dataclasses import asdict

from braidtrain.plan.memory import GB

COLUMNS = ("params", "grads", "optimizer", "activations", "comm", "overhead")


def row_json(e: dict) -> dict:
    return {**asdict(e["layout"]), "micro_steps": e["micro_steps"], "fits": e["fits"],
            "mem_gb": {k: v / GB for k, v in e["mem"].items()}, "allocated_gb": e["allocated"] / GB,
            "activations_gb": {k: v / GB for k, v in e["activations"].items()},
            "compute_s": e["compute_s"], "exposed_comm_s": e["comm_s"], "dp_exposed_comm_s": e["dp_comm_s"],
            "tp_comm_s": e["tp_comm_s"], "pp_comm_s": e["pp_comm_s"], "cp_comm_s": e["cp_comm_s"],
            "step_s": e["step_s"], "tokens_per_s": e["tokens_per_s"], "fix": e.get("fix"),
            "host_gb": e["host"] / GB, "offload_s": e["offload_s"],
            **({"bubble": e["bubble"], "stages_gb": e["stages_gb"]} if "bubble" in e else {})}


def table(result: dict, top: int) -> str:
    """The ranked rows; the tp and sp columns only when a row shown has tp > 1, the pipeline's
    (pp, its schedule, the largest of its ranks' bubbles: the first stage's, the papers') when one
    has pp > 1; memory is the fullest rank's."""
    shown = result["rows"][:top] if top > 0 else result["rows"]
    tp, pp = any(e["layout"].tp > 1 for e in shown), any(e["layout"].pp > 1 for e in shown)
    cp, ep = any(e["layout"].cp > 1 for e in shown), any(e["layout"].ep > 1 for e in shown)
    off = any(e["layout"].offload for e in shown)  # the host's column: a node's GB under --offload
    head = ["dp", *(["tp", "sp"] if tp else []), *(["pp", "sched", "bubble"] if pp else []), *(["cp"] if cp else []),
            *(["ep"] if ep else []),
            "zero", "b", "micro",
            "recomp", *(["offload", "host GB"] if off else []), "mem GB", "params", "grads", "optim", "activ", "comm",
            "ovhd", "step s", "tokens/s", "fits"]
    lines = [head]
    for e in shown:
        lay, m = e["layout"], e["mem"]
        mesh = [lay.tp, "on" if lay.sp else "off"] if tp else []
        if pp:
            pipe = "-" if lay.pp == 1 else lay.schedule + (f"x{lay.virtual}" if lay.virtual > 1 else "")
            bubble = f"{max(e['bubble']):.0%}" if lay.pp > 1 else "-"
            mesh += [lay.pp, pipe, bubble]
        mesh += [f"{lay.cp}" + ("ag" if lay.cp_impl == "allgather" else "") if lay.cp > 1 else 1] if cp else []
        mesh += [lay.ep] if ep else []
        said = (f"R {lay.ratio:g}" if lay.ratio < 1 else "on") if lay.offload else "off"
        host = [said, f"{e['host'] / GB:.1f}" if lay.offload else "-"] if off else []
        lines.append([lay.dp, *mesh, lay.zero, lay.b, e["micro_steps"], "on" if lay.recompute else "off", *host,
                      f"{m['total'] / GB:.1f}", *(f"{m[k] / GB:.2f}" for k in COLUMNS),
                      f"{e['step_s']:.3f}", f"{e['tokens_per_s']:,.0f}", "yes" if e["fits"] else "NO"])
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(head))]
    out = ["  ".join(str(v).rjust(w) for v, w in zip(r, widths)) for r in lines]
    if len(shown) < len(result["rows"]):
        out.append(f"({len(result['rows']) - len(shown)} more layouts: --top 0 shows all)")
    fixes = [e["fix"] for e in shown if e["fix"]]
    out += fixes[:4] + ([f"({len(fixes) - 4} more such lines: --json has a fix for every "
                         "layout)"] if len(fixes) > 4 else [])
    return "\n".join(out + [result["recommendation"]])
