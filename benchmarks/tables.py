"""Every results table in the docs, generated from the committed JSON under benchmarks/results/.

    python -m benchmarks.tables            # rewrite every marked block in README.md and docs/*.md
    python -m benchmarks.tables --check    # exit 1 naming each block that differs (tests/project/test_results.py)

A doc asks for a table with a pair of markers; everything between them is this script's:

    <!-- table:wan-1.3b -->
    <!-- /table:wan-1.3b -->

Each table names its source file(s), the card and the commit they measured. A results file
whose recorded commit is not the tree that ran (written before the harness read git itself;
`UNKNOWN_COMMITS`) shows its commit as unknown: such a file is re-measured, never corrected
by hand. Numbers are copied from the JSON as recorded (rounded for display); a ratio is
always between two rows of the same file, i.e. of the same run on the same card -- except the
whole-generation table's, whose one measurement spans a file per call of the script: there
between rows of the same (clean) commit and card.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from benchmarks.whole_generation import ROWS as WHOLE_GENERATION_ROWS  # the harness's rows, in its order

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"(<!-- table:([\w.-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)
COMMIT = re.compile(r"[0-9a-f]{7,40}(\+dirty)?")

# Files whose recorded commit is not the tree that ran; the generator shows "unknown" for them.
UNKNOWN_COMMITS = {
    "attention/attention_backends_wan2.1-t2v-1.3b_h200.json": "records no commit",
    "qwen3-omni/qwen3-omni_decode_h200.json": "records 'HEAD'",
    **dict.fromkeys(("profiles/profile_flux.1-dev_fp8_graphs_h100.json",
                     "profiles/profile_flux.1-dev_bf16_graphs_cdt_h100.json",
                     "profiles/profile_flux.1-dev_fp8_graphs_cdt_h100.json"),
                    "corrected by hand (the commit given on the device was mistyped)"),
    "offload/offload_h100_flux.1-dev_refit_inference_mode.json":
        "written in after the run (a placeholder was given on the device)",
    "kernels/norm_rope_heads_h100.json": "corrected by hand (the device's stale git HEAD)",
    "wan2.1-i2v-14b/wan2.1-i2v-14b-480p_480x832x81_cfg_fast_h100.json":
        "corrected by hand (the device's stale git HEAD)",
    "flux/flux.1-dev_1024x1024_graphs_h100.json": "names the device's stale git HEAD, not the tree that ran",
    "ltx-2/ltx-2-8L_512x768x121_fa3_h200.json": "names a commit that does not exist (mistyped when given on the device)",
}


@dataclass(frozen=True)
class Result:
    """One committed results file."""

    rel: str  # path under benchmarks/results/
    data: dict

    @property
    def env(self) -> dict:
        d = self.data
        env = d.get("env") or d.get("environment")
        if env is None and d.get("rows"):  # parallel.py records the environment per row
            env = d["rows"][0].get("env")
        return env or d  # the oldest files kept card and commit at the top level

    @property
    def card(self) -> str:
        return str(self.env.get("card") or "unknown")

    @property
    def commit(self) -> str:
        """The commit as shown: 12 digits, "(dirty)" / "(given)" where recorded so; unknown where
        the file records none, something that is no hash, or a commit known to be wrong."""
        env = self.env
        raw = str(env.get("commit") or "")
        if self.rel in UNKNOWN_COMMITS or not COMMIT.fullmatch(raw):
            return "unknown"
        dirty = raw.endswith("+dirty") or env.get("commit_dirty") is True
        sha = raw.removesuffix("+dirty")[:12]
        return sha + (" (dirty)" if dirty else "") + (" (given)" if env.get("commit_source") == "given" else "")

    def rows(self, key: str = "results") -> list[dict]:
        return list(self.data.get(key) or [])

    def row(self, strategy: str, key: str = "results") -> dict:
        for r in self.rows(key):
            if r.get("strategy") == strategy:
                return r
        raise KeyError(f"{self.rel}: no {strategy!r} row")


@lru_cache(maxsize=None)
def load(rel: str) -> Result:
    path = RESULTS / rel
    if not path.is_file():
        raise FileNotFoundError(f"benchmarks/results/{rel}: a table's source is missing (moved or deleted?)")
    return Result(rel, json.loads(path.read_text()))


# -- formatting ----------------------------------------------------------------------------------

def num(v: Any, digits: int = 1) -> str:
    return "—" if v is None else f"{float(v):,.{digits}f}"


def ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def sci(v: Any) -> str:
    """1.29e-2, as the results tables print errors."""
    if v is None:
        return "—"
    if float(v) == 0:
        return "0"
    mant, exp = f"{float(v):.2e}".split("e")
    return f"{mant}e{int(exp)}"


def faster(baseline: float | None, value: float | None) -> float | None:
    """How many times faster `value` is than `baseline`, both times (ms, s/it)."""
    return baseline / value if baseline and value else None


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


Link = Callable[[str], str]  # results rel path -> markdown link from the doc being written


def sources(results: list[Result], link: Link) -> str:
    """The line under every table: each source file with its card and commit."""
    parts = [f"{link(r.rel)} ({r.card}, commit {r.commit})" for r in results]
    commands = [f"`{r.data['command']}`" for r in results if r.data.get("command")]
    return "Source: " + "; ".join(parts) + "." + (" Command: " + "; ".join(commands) + "." if commands else "")


# -- the tables ----------------------------------------------------------------------------------

HARNESS_NAMES = {"eager": "eager", "diffusers_regional": "diffusers `compile_repeated_blocks` (SDPA)",
                 "diffusers_regional_fa3": "diffusers `compile_repeated_blocks`, FA3 (the same kernel)",
                 "diffusers_regional_fa3_varlen": "diffusers `compile_repeated_blocks`, FA3 varlen (the same kernel, "
                                                  "masks as key padding)",
                 "diffusers_fp8": "diffusers `compile_repeated_blocks`, FA3, torchao fp8 (per-row) + fp8 FA3 (per-tensor)",
                 "magi_zoo_unfused": "magi_zoo, fusions off", "magi_zoo": "**magi_zoo**",
                 "magi_zoo_fp8": "**magi_zoo, fp8**",
                 "magi_zoo_graphs": "magi_zoo, forward in a CUDA graph",
                 "magi_zoo_sdpa": "magi_zoo, its attention regions on SDPA",
                 "magi_zoo_fa3": "magi_zoo, its attention on FA3",
                 "magi_zoo_fp8_graphs": "magi_zoo, fp8, forward in a CUDA graph"}

WAN_13B = "wan2.1-t2v-1.3b/wan2.1-t2v-1.3b_480x832x81_baselines_h100.json"  # the same-kernel baselines' run
WAN_13B_FUSIONS = "wan2.1-t2v-1.3b/wan2.1-t2v-1.3b_480x832x81_fused_h100.json"  # + fusions off, error vs fp32
WAN_13B_WARM = "wan2.1-t2v-1.3b/wan2.1-t2v-1.3b_480x832x81_fp8warm_final_h100.json"
# The shipped plan beside its same-kernel baseline on the H100 (its last row, diffusers on SDPA,
# was cut off by the device's time limit), then the two H100 runs of the same day that moved the
# bf16 attention to FA3 (flux.toml): the plan on SDPA beside both diffusers rows and fp8, and the
# plan on SDPA beside the plan on FA3 (`magi_zoo_fa3`).
FLUX = "flux/flux.1-dev_1024x1024_shipped_h100.json"
FLUX_SAME_DAY = ("flux/flux.1-dev_1024x1024_fa3_bf16_h100.json", "flux/flux.1-dev_1024x1024_samekernel_h100.json")
FLUX_FUSIONS = "flux/flux.1-dev_1024x1024_fused2_h100.json"  # + fusions off, error vs fp32 (SDPA baseline only)
FLUX_BASELINES = "flux/flux.1-dev_1024x1024_baselines_h100.json"  # the same-kernel baselines (a run cut short)
# The same-kernel baselines beside the shipped plan in one run on an H200, whose plan takes FA3
# in bf16 (no diffusers_fp8 row: its compile alone ran 436 s on the H100)
FLUX_SAME_KERNEL = "flux/flux.1-dev_1024x1024_fa3bf16_h200.json"
# Kernel-by-kernel profiles of the shipped plan and of its same-kernel baseline (benchmarks.
# profile_forward, `--baseline diffusers_regional_fa3`), one card and commit per pair, with the
# speed goal each model has against that baseline (issue 30: Wan2.1-1.3B 1.10x, Flux.1-dev
# 1.08x; issue 33: FLUX.2 1.05x), so the table can say what the goal leaves for the kernels the
# engine does not share with diffusers.
PROFILE_PAIRS = (
    ("FLUX.2-dev, all 8 + 48 blocks, 768×1360", "profiles/profile_flux.2-dev_shipped_h200.json",
     "profiles/profile_flux.2-dev_diffusers_regional_fa3_h200.json", 1.05),
    ("Wan2.1-T2V-1.3B, 480×832×81", "profiles/profile_wan2.1-t2v-1.3b_shipped_h200.json",
     "profiles/profile_wan2.1-t2v-1.3b_diffusers_regional_fa3_h200.json", 1.10),
    ("Flux.1-dev, 1024×1024", "profiles/profile_flux.1-dev_shipped_h200.json",
     "profiles/profile_flux.1-dev_diffusers_regional_fa3_h200.json", 1.08),
)
PROFILE_CATEGORIES = ("gemm", "attention", "triton_pointwise", "triton_reduction", "triton_other", "other")
I2V_LOOP = ("wan2.1-i2v-14b/denoise_loop_wan2.1-i2v-14b-480p_bf16_15steps_h100.json",
            "wan2.1-i2v-14b/denoise_loop_wan2.1-i2v-14b-480p_fp8_15steps_h100.json")
OFFLOAD_FLUX = "offload/offload_h100_flux.1-dev_pool.json"
OFFLOAD_I2V = ("offload/offload_h100_wan2.1-i2v-14b-480p_16_24gib.json",
               "offload/offload_h100_wan2.1-i2v-14b-480p_16_40gib.json",
               "offload/offload_h100_wan2.1-i2v-14b-480p_12gib_diffusers.json",
               "offload/offload_h100_wan2.1-i2v-14b-480p_24gib_diffusers.json")
# The newer families' largest published variants under 24 GiB (`benchmarks.offload --models ...`,
# issue 33): a file not yet committed is listed as unmeasured.
OFFLOAD_FAMILIES = {"Qwen-Image": ("offload/offload_h100_qwen-image.json", "offload/offload_h200_qwen-image.json",
                                   "offload/offload_h200_qwen-image_fp8.json"),  # the fp8 rows (--label fp8)
                    "FLUX.2-dev": ("offload/offload_h100_flux.2-dev.json", "offload/offload_h200_flux.2-dev.json",
                                   "offload/offload_h200_flux.2-dev_fp8.json"),
                    "HunyuanVideo-1.5": ("offload/offload_h200_hunyuanvideo-1.5-480p-t2v.json",),
                    "LTX-2": ("offload/offload_h100_ltx-2.json", "offload/offload_h200_ltx-2.json")}
TRAIN = "train/train_wan2.1-t2v-1.3b_h100_noopt.json"
TRAIN_MULTI = ("train/train_dp_wan2.1-t2v-1.3b_h100.json", "train/train_fsdp_wan2.1-t2v-14b_h100.json",
               "train/train_fsdp_wan2.1-t2v-14b_h100_cpuoffload.json")
# The Self-Forcing runs, oldest first: the contiguous VAE after each block (with the SDPA naive
# port), the shipped decode settings, and the naive port on SDPA and on the FA3 kernel beside the
# shipped strategy (the same-kernel baseline).
SELF_FORCING = ("self_forcing/self_forcing_h100_vae_contig_serial.json", "self_forcing/self_forcing_h100.json",
                "self_forcing/self_forcing_h100_same_kernel.json")
PARALLEL = ("parallel/parallel_h100_2gpu.json", "parallel/parallel_h200_4gpu.json")
# The newer families' harness runs, at the stems docs/models.md's commands write: a run not yet
# committed is listed as such, so the table says what is still unmeasured.
FAMILIES = {"FLUX.2-dev": ("flux/flux.2-dev-4L_768x1360_h100.json",
                           # with and without the forward in one CUDA graph (a run cut short)
                           "flux/flux.2-dev-4L_768x1360_graphs_h200.json",
                           # fp8 with and without the graph, the row the run above did not reach
                           "flux/flux.2-dev-4L_768x1360_fp8_graphs_h200.json",
                           # after the q/k norm + rope fusion (adapters/flux2/attention.py), with it off
                           "flux/flux.2-dev-4L_768x1360_fused_h200.json",
                           # at the published depth (8 + 48 blocks), the shipped plan against diffusers on FA3
                           "flux/flux.2-dev_768x1360_full_h200.json"),
            "Qwen-Image": ("qwen-image/qwen-image-20L_1328x1328_h100.json",
                           # after the q/k norm + rope fusion (adapters/qwen_image/attention.py)
                           "qwen-image/qwen-image_20L_h200.json",
                           # with and without the forward in one CUDA graph (the shipped Hopper plan since)
                           "qwen-image/qwen-image-20L_1328x1328_graphs_h200.json"),
            "HunyuanVideo-1.5": ("hunyuanvideo-1.5-480p-t2v/hunyuanvideo-1.5-480p-6L_480x848x121_h100.json",
                                 "hunyuanvideo-1.5-480p-t2v/hunyuanvideo-1.5-480p-6L_480x848x121_h200.json"),
            "LTX-2": ("ltx-2/ltx-2-8L_512x768x121_h100.json", "ltx-2/ltx-2-8L_512x768x121_h200.json",
                      # the fp8 row again after the spec kept the audio-to-video linears bf16
                      "ltx-2/ltx-2-8L_512x768x121_fp8keep_h200.json",
                      # and once more, the next session (the run above was 35% slower than this one)
                      "ltx-2/ltx-2-8L_512x768x121_fp8keep2_h200.json",
                      # with the video-to-audio cross-attention's linears kept bf16 too
                      "ltx-2/ltx-2-8L_512x768x121_fp8keep3_h200.json",
                      # with and without the forward in one CUDA graph (the shipped Hopper plan since)
                      "ltx-2/ltx-2-8L_512x768x121_graphs_h200.json",
                      # the shipped plan (graphs on) beside every baseline, fp32 reference (diffusers_fp8 cut off)
                      "ltx-2/ltx-2-8L_512x768x121_baselines_h200.json",
                      # with FA3 for the unmasked attentions, beside the same plan on SDPA
                      "ltx-2/ltx-2-8L_512x768x121_fa3_h200.json",
                      # the same again at a commit the run recorded
                      "ltx-2/ltx-2-8L_512x768x121_fa3_rerun_h200.json"),
            # a fifth family, through the contributor guide (bf16 only: its spec declares no fp8 regions)
            "Z-Image": ("z-image-turbo/z-image-turbo-10L_1024x1024_h100.json",
                        # its attention on SDPA beside the shipped FA3 (the unfused row cut off)
                        "z-image-turbo/z-image-turbo-10L_1024x1024_attention_h100.json")}


# The baselines a speed claim may be made against (benchmarks/baselines.py): a bf16 row is compared
# with the fastest bf16 baseline in its run, an fp8 row with the fastest of all of them.
BF16_BASELINES = ("diffusers_regional", "diffusers_regional_fa3", "diffusers_regional_fa3_varlen")
FP8_BASELINES = ("diffusers_fp8",)


def strongest_baseline(r: Result, strategy: str) -> tuple[str, float] | None:
    """(name, ms) of the fastest baseline measured in `r` that `strategy` is compared with."""
    names = BF16_BASELINES + (FP8_BASELINES if "fp8" in strategy else ())
    measured = [(x["strategy"], x["median_ms"]) for x in r.rows()
                if x.get("strategy") in names and x.get("status") == "ok" and x.get("median_ms")]
    return min(measured, key=lambda m: m[1]) if measured else None


def harness(rel: str, strategies: list[str], link: Link) -> str:
    """benchmarks.run rows: ms per forward, each row against the strongest baseline of its run
    (the fastest of diffusers' regional compile on SDPA, on the same FA3 kernel, and -- for fp8
    rows -- with torchao's fp8 and fp8 FA3), and against diffusers' regional compile on SDPA."""
    r = load(rel)
    # a run may leave the SDPA row out (it measured the same-kernel baseline only): no ratio then
    sdpa = next((x.get("median_ms") for x in r.rows() if x.get("strategy") == "diffusers_regional"), None)
    # the error against an fp32 forward where the run measured one (--fp32-reference), else against eager
    error = "rel_err_vs_fp32" if any(r.row(s).get("rel_err_vs_fp32") is not None for s in strategies) \
        else "rel_err_vs_eager"
    rows = []
    for s in strategies:
        x = r.row(s)
        best = strongest_baseline(r, s)
        vs_best = "—" if best is None else f"{ratio(faster(best[1], x.get('median_ms')))} (`{best[0]}`)"
        rows.append([HARNESS_NAMES.get(s, s), num(x.get("median_ms")), vs_best, ratio(faster(sdpa, x.get("median_ms"))),
                     sci(x.get(error)), num(x.get("peak_gib"))])
    shape = r.data["shape"]
    what = f"{r.data['model']}, {shape['height']}×{shape['width']}"
    what += f"×{shape['frames']}" if shape.get("frames") else ""
    head = [what, "ms / forward", "vs the strongest baseline", "vs diffusers regional (SDPA)",
            f"rel. error vs {error.rsplit('_', 1)[1]}", "peak GiB"]
    note = f"\n\nBuild: {r.data['variant_note']}." if r.data.get("variant_note") else ""
    if not any(x.get("strategy") in BF16_BASELINES[1:] + FP8_BASELINES for x in r.rows()):
        note += "\n\n" + sdpa_only_note(r, strategies)
    return table(head, rows) + note + "\n\n" + sources([r], link)


def sdpa_only_note(r: Result, strategies: list[str]) -> str:
    """What a run whose only baseline is diffusers on SDPA can claim: the same kernel where every
    magi_zoo row recorded the library's default attention (benchmarks.run writes `attention`),
    else ratios that may include a kernel change."""
    zoo = [r.row(s) for s in strategies if s.startswith("magi_zoo")]
    if zoo and all(x.get("attention") == [] for x in zoo):
        return ("Every magi_zoo row ran diffusers' default attention (SDPA), as diffusers' rows did, so "
                "`diffusers_regional` is the same-kernel baseline here.")
    other = sorted({b for x in zoo for b in x.get("attention") or []})
    if other:
        return (f"This run's only baseline is diffusers on SDPA, and magi_zoo's rows ran other attention kernels "
                f"({'; '.join(other)}): its ratios include the kernel, not only the engine's own work.")
    return ("This run's only baseline is diffusers on SDPA and its records do not say which attention magi_zoo's "
            "rows ran: where that was another kernel (FA3), its ratios include the kernel, not only the engine's "
            "own work; a run with the same-kernel baseline, where there is one, is listed beside it.")


def failure(error: str | None) -> str:
    """The message of a failed row's exception, as recorded by the harness. An error raised in
    a compiled region reaches it wrapped by dynamo, whose debug context quotes the message."""
    text = (error or "no error recorded").strip()
    quoted = re.search(r'raised exception \w+\(\[ConstantVariable\(str: "(.*?)"\)\]\)', text)
    return quoted.group(1) if quoted else text.splitlines()[0]


def committed(rels: tuple[str, ...]) -> list[str]:
    """The results files of `rels` that are committed (a run not yet made is listed as such)."""
    return [rel for rel in rels if (RESULTS / rel).exists()]


def families(link: Link) -> str:
    """One harness table per newer family with a committed run (the rows that run measured),
    then the families whose run is not committed yet."""
    parts, missing = [], []
    for family, rels in FAMILIES.items():
        present = committed(rels)
        if not present:
            missing.append(family)
        parts.extend(_family_run(family, rel, link) for rel in present)
    if missing:
        parts.append(f"Not yet measured on a GPU: {', '.join(missing)}.")
    return "\n\n".join(parts)


def _family_run(family: str, rel: str, link: Link) -> str:
    """One family's harness run: its table, then the rows it did not measure, with why."""
    r = load(rel)
    measured = [x["strategy"] for x in r.rows() if x.get("status") == "ok"]
    failed = [f"- {HARNESS_NAMES.get(x['strategy'], x['strategy'])}: {x.get('status')}: {failure(x.get('error'))}"
              for x in r.rows() if x.get("status") != "ok"]
    if not r.data.get("complete", True):
        failed.append(f"- incomplete run: it stopped after {len(r.rows())} of its strategies (the command names "
                      "them all)")
    return (f"**{family}** ({r.card})\n\n" + harness(rel, measured, link)
            + ("\n\nNot measured in this run:\n\n" + "\n".join(failed) if failed else ""))


def baseline_rows(rel: str, link: Link) -> str:
    """The rows a run measured, including one cut short (its record says incomplete): ms per
    forward and error, no ratio to a row the run did not reach."""
    r = load(rel)
    rows = [[HARNESS_NAMES.get(x["strategy"], x["strategy"]), num(x.get("median_ms")), sci(x.get("rel_err_vs_fp32")),
             num(x.get("first_call_s")), num(x.get("peak_gib"))] for x in r.rows() if x.get("status") == "ok"]
    shape = r.data["shape"]
    head = [f"{r.data['model']}, {shape['height']}×{shape['width']}", "ms / forward", "rel. error vs fp32",
            "first call, s", "peak GiB"]
    done = "" if r.data.get("complete", True) else (
        f"\n\nIncomplete run: it stopped after {len(r.rows())} of its strategies (the command names them all), so no "
        "ratio is drawn from it.")
    return table(head, rows) + done + "\n\n" + sources([r], link)


def wan_13b(link: Link) -> str:
    return harness(WAN_13B, ["eager", "diffusers_regional", "diffusers_regional_fa3", "diffusers_fp8", "magi_zoo",
                             "magi_zoo_fp8"], link)


def wan_13b_fusions(link: Link) -> str:
    return harness(WAN_13B_FUSIONS, ["eager", "diffusers_regional", "magi_zoo_unfused", "magi_zoo", "magi_zoo_fp8"],
                   link)


def flux(link: Link) -> str:
    """The shipped plan's run, then the earlier runs of the same day, each with the attention its
    magi_zoo rows recorded (the plan's bf16 attention changed between them)."""
    parts = []
    for label, rel in (("The shipped plan", FLUX), *(("An earlier run", rel) for rel in FLUX_SAME_DAY)):
        r = load(rel)
        parts.append(_family_run(f"{label}, commit {r.commit}", rel, link) + "\n\n" + attention_note(r))
    return "\n\n".join(parts)


def attention_note(r: Result) -> str:
    """The attention kernel each bf16 magi_zoo row of `r` recorded (benchmarks.run writes the
    attention step's choice as `attention`; an fp8 row's precision step may move layers to fp8
    attention after it, so fp8 rows are not described by it)."""
    said = []
    for x in r.rows():
        s = x.get("strategy", "")
        if s.startswith("magi_zoo") and "fp8" not in s and x.get("status") == "ok" and "attention" in x:
            kernels = "; ".join(x["attention"]) or "the library default (SDPA), as diffusers' default rows"
            said.append(f"{HARNESS_NAMES.get(s, s)}: {kernels}")
    return "bf16 attention: " + (" -- ".join(said) if said else "not recorded by this run") + "."


def flux_fusions(link: Link) -> str:
    return harness(FLUX_FUSIONS, ["eager", "diffusers_regional", "magi_zoo_unfused", "magi_zoo", "magi_zoo_fp8"],
                   link)


def flux_baselines(link: Link) -> str:
    same_kernel = ["eager", "diffusers_regional", "diffusers_regional_fa3", "magi_zoo", "magi_zoo_fp8"]
    return baseline_rows(FLUX_BASELINES, link) + "\n\n" + harness(FLUX_SAME_KERNEL, same_kernel, link)


def _profile(rel: str) -> tuple[Result, dict[str, float], float, str]:
    """(the record, ms per forward by kernel category, the unprofiled forward's median ms, the
    plan's attention as the record says it) of a benchmarks.profile_forward record."""
    r = load(rel)
    cats = {row["category"]: row["ms_per_forward"] for row in r.data["summary"]}
    attention = (r.data.get("plan") or "not recorded").split(" | ")[0]
    return r, cats, r.data["timing"]["median_ms"], attention


def profile_pairs(link: Link) -> str:
    """Per model, the shipped plan's and its same-kernel baseline's GPU time by kernel category,
    and what the speed goal leaves: the goal's forward time (the baseline's forward / the goal
    ratio) minus the baseline's own GEMM and attention time (the same cuBLAS and FA3 kernels on
    the same shapes) is what every other kernel and launch gap may take at the goal, beside what
    the shipped plan spends on them now (its forward minus its own GEMM and attention)."""
    parts = []
    for what, shipped_rel, base_rel, goal in PROFILE_PAIRS:
        (shipped, ours, ours_ms, attention), (baseline, base, base_ms, _) = _profile(shipped_rel), _profile(base_rel)
        rows = [[c, num(ours.get(c, 0.0), 2), num(base.get(c, 0.0), 2)] for c in PROFILE_CATEGORIES
                if c in ours or c in base]
        rows.append(["forward, unprofiled (median of 5)", num(ours_ms, 1), num(base_ms, 1)])
        rows.append(["baseline / shipped", ratio(faster(base_ms, ours_ms)), "1.00×"])
        shared = base["gemm"] + base["attention"]
        allowed = base_ms / goal - shared
        now = ours_ms - ours["gemm"] - ours["attention"]
        parts.append(
            f"**{what}** ({shipped.card}; shipped plan at {shipped.commit}, baseline at {baseline.commit})\n\n"
            + table(["GPU ms per forward", "shipped plan", "diffusers regional, FA3"], rows)
            + f"\n\nAt the goal ({ratio(goal)} the baseline) a forward takes {num(base_ms / goal, 1)} ms; the "
            f"baseline's GEMMs and attention take {num(shared, 1)} ms of it, which leaves {num(allowed, 1)} ms for "
            f"every other kernel and launch gap. The shipped plan spends {num(now, 1)} ms on them now. Its "
            f"attention: {attention}."
            f"\n\nSources: {link(shipped_rel)}, {link(base_rel)}.")
    return "\n\n".join(parts)


def warm_start(link: Link) -> str:
    r = load(WAN_13B_WARM)
    rows = []
    for x in r.rows():
        if x.get("warm_first_call_s_all"):
            rows.append([HARNESS_NAMES.get(x["strategy"], x["strategy"]), num(x.get("first_call_s")),
                         num(x.get("warm_first_call_s")), " / ".join(num(s, 2) for s in x["warm_first_call_s_all"])])
    head = ["Wan2.1-T2V-1.3B first call", "cold process, s", "warm process, s (median)", "each warm process, s"]
    return table(head, rows) + "\n\n" + sources([r], link)


def i2v_loop(link: Link) -> str:
    files = [load(rel) for rel in I2V_LOOP]
    base = files[0].data["row"]["s_per_it_median"]
    rows = [[f"{f.data['row']['precision']}", num(f.data["row"]["s_per_it_median"], 2),
             ratio(faster(base, f.data["row"]["s_per_it_median"])), num(f.data["row"]["peak_gib"]),
             num(f.data["row"]["vae_decode_s"], 2)] for f in files]
    row = files[0].data["row"]
    head = [f"{row['model']}, {row['shape']}, CFG {row['cfg']}, {row['steps']} steps", "s / it",
            "vs bf16", "peak GiB", "VAE decode, s"]
    return table(head, rows) + "\n\n" + sources(files, link)


# benchmarks/whole_generation.py at LightX2V's workload: its 480P rows, one file per call of the
# script (`--label`); the folder is globbed, so a new call's file joins the table as committed.
WHOLE_GENERATION = ("wan2.1-i2v-14b", "whole_generation_wan2.1-i2v-14b-480p_*.json")
WHOLE_GENERATION_MODEL = "wan2.1-i2v-14b-480p"
WHOLE_GENERATION_SHAPE, WHOLE_GENERATION_STEPS = "480x832x81", 40  # LightX2V's configs/bench/*.json
WHOLE_GENERATION_NAME = re.compile(r"whole_generation_(?P<model>[^_]+)_(?P<steps>\d+)steps(?:_(?P<label>[\w-]+))?"
                                   r"_(?P<card>[^_]+)\.json")


def _whole_generation_row(x: dict, data: dict) -> str:
    """What a whole-generation row ran, in a few words (the record's `what` names every fusion)."""
    row = x["row"]
    if row == "distill":
        return f"distilled {x.get('steps', '?')}-step, fp8 (`{data.get('distill_model', 'distill')}`)"
    if row == "fp8_cache":
        psnr = x.get("psnr_vs_fp8_db")
        return (f"fp8 + step cache (`{data.get('cache', '?')}`)"
                + ("" if psnr is None else f", PSNR vs fp8 {num(psnr)} dB"))
    if row == "diffusers":
        return "diffusers pipeline, regional compile, FA3 (the baseline)"
    return row


def _whole_generation_weights(x: dict, data: dict) -> str:
    """random / checkpoint for a row: the distilled row loads its own weights, which a record
    names only where the harness wrote `distill_weights`."""
    weights = data.get("distill_weights", "not recorded") if x["row"] == "distill" else data.get("weights")
    return weights if weights in ("random", "not recorded", None) else "checkpoint"


def _whole_generation_call(r: Result) -> str:
    """The card and the `--label` a file was written under: which call of the script a row is
    from (the file names follow the table, with card and commit)."""
    m = WHOLE_GENERATION_NAME.fullmatch(r.rel.rsplit("/", 1)[-1])
    label = m["label"] if m and m["label"] else None
    return r.card.replace("NVIDIA ", "") + (f", `{label}`" if label else ", no label")


def whole_generation_files() -> tuple[list[Result], list[str]]:
    """The committed whole-generation files of the 480P model on a GPU, and apart from them the
    names of those that are not at LightX2V's workload (a short run's steps or frames)."""
    topic, pattern = WHOLE_GENERATION
    at, off = [], []
    for path in sorted((RESULTS / topic).glob(pattern)):
        r = load(path.relative_to(RESULTS).as_posix())
        m = WHOLE_GENERATION_NAME.fullmatch(path.name)
        # the CPU smoke runs a tiny model (and names itself so): the plumbing, not a measurement
        if r.data.get("smoke") or r.data.get("model") != WHOLE_GENERATION_MODEL or (m and m["card"] == "cpu"):
            continue
        shapes = {x["shape"] for x in r.rows("rows") if x.get("shape")}
        if m is None or int(m["steps"]) != WHOLE_GENERATION_STEPS or shapes - {WHOLE_GENERATION_SHAPE}:
            off.append(path.name)
        else:
            at.append(r)
    return at, off


def _measurement(r: Result) -> tuple[str, str, bool]:
    """Which measurement a whole-generation file belongs to: its card, its commit and whether it
    wrote the .mp4 (the same work). The rows of one measurement span several files (one per
    call, `--label`); a file of unknown or dirty commit names no one tree, so it is a
    measurement of its own."""
    tree = r.rel if r.commit == "unknown" or "(dirty)" in r.commit else r.commit
    return r.card, tree, bool(r.data.get("frames_written"))


def _diffusers_baselines(files: list[Result]) -> dict[tuple[str, str, bool], float]:
    """The fastest ok `diffusers` row's whole_s per measurement (`_measurement`)."""
    out: dict[tuple[str, str, bool], float] = {}
    for f in files:
        for x in f.rows("rows"):
            if x.get("row") == "diffusers" and x.get("status") == "ok" and x.get("whole_s"):
                key = _measurement(f)
                out[key] = min(out.get(key, x["whole_s"]), x["whole_s"])
    return out


def whole_generation(link: Link) -> str:
    """benchmarks.whole_generation's 480P rows at LightX2V's workload, every committed file: the
    whole call and its phases, each row against the diffusers row of the same commit and card
    where one was measured; the rows that failed, and the files of a shorter run, named below."""
    files, off = whole_generation_files()
    skipped = ([f"Not at the workload ({WHOLE_GENERATION_STEPS} steps, {WHOLE_GENERATION_SHAPE}), so not shown: "
                + ", ".join(f"`{name}`" for name in off) + "."] if off else [])
    if not files:
        return "\n\n".join(["No result at the workload is committed yet.", *skipped])
    baselines = _diffusers_baselines(files)
    order = {row: i for i, row in enumerate(WHOLE_GENERATION_ROWS)}
    measured, failed, unmatched = [], [], False
    for f in files:
        written = bool(f.data.get("frames_written"))
        base = baselines.get(_measurement(f))
        for x in f.rows("rows"):
            if x.get("status") != "ok":
                failed.append(f"- {x.get('row')} ({_whole_generation_call(f)}): {x.get('status')}: "
                              f"{failure(x.get('error'))}")
                continue
            unmatched |= base is None
            guidance = x.get("guidance")
            cfg = "—" if guidance is None else (f"yes ({num(guidance)})" if guidance > 1 else "no")
            encoders = [x.get(k) for k in ("text_encoder_s", "image_encoder_s") if x.get(k) is not None]
            # the call's time in no timed phase (pre- and post-processing): what the phases leave of it
            phases = [x.get(k) or 0.0 for k in ("text_encoder_s", "image_encoder_s", "vae_encode_s", "denoise_s",
                                                 "vae_decode_s", "write_frames_s")]
            untimed = x["whole_s"] - sum(phases) if x.get("whole_s") and x.get("denoise_s") else None
            # the distilled model runs another sampler (4 steps, no CFG): a ratio to the 40-step
            # baseline would be the distillation's, not the engine's
            versus = "— (another sampler)" if x["row"] == "distill" else ratio(faster(base, x.get("whole_s")))
            cells = [_whole_generation_row(x, f.data), str(x.get("steps", "—")), cfg, num(x.get("whole_s")),
                     num(sum(encoders), 2) if encoders else "—", num(x.get("vae_encode_s"), 2),
                     num(x.get("denoise_s")), num(x.get("s_per_step_median"), 2), num(x.get("vae_decode_s"), 2),
                     num(untimed, 2), "yes" if written else "no (`--no-write`)", versus,
                     _whole_generation_weights(x, f.data), _whole_generation_call(f)]
            measured.append(((f.card, f.commit, order.get(x["row"], len(order)), f.rel), cells))
    head = [f"{WHOLE_GENERATION_MODEL}, {WHOLE_GENERATION_SHAPE}", "steps", "CFG", "whole call, s",
            "text + image encoders, s", "VAE encode, s", "denoise, s", "s / step (median)", "VAE decode, s",
            "untimed (pre- / post-processing), s", "frames written (.mp4)", "vs diffusers (same commit, card)", "weights", "card, call (`--label`)"]
    notes = []
    if unmatched:
        notes.append("vs diffusers is — where no `diffusers` row was measured on the same commit and card (with the "
                     "frames written alike): no ratio is drawn across trees or cards.")
    if failed:
        notes.append("Not measured:\n\n" + "\n".join(failed))
    # the harness rewrites its file after every row: one cut short keeps the rows it finished
    notes += [f"Incomplete run: `{f.rel.rsplit('/', 1)[-1]}` stopped after {len(f.rows('rows'))} of the rows it was "
              "asked for." for f in files if not f.data.get("complete", True)]
    notes += skipped
    rows = [cells for _, cells in sorted(measured, key=lambda m: m[0])]
    return "\n\n".join([table(head, rows), *notes, sources(files, link)])


def _resident_row(r: Result) -> dict | None:
    """The run's resident row (every weight on the card), where it measured one."""
    return next((x for x in r.rows("rows") if x.get("strategy") == "resident" and x.get("median_ms")), None)


def _offload_cells(x: dict, resident_ms: float | None) -> list[str]:
    """A row's model, strategy, budget, ms per forward -- or, for a row that did not finish, what
    stopped it -- and its speed against its run's resident row."""
    ok = x.get("status") == "ok"
    budget = "—" if x.get("budget_gib") is None else num(x["budget_gib"], 0)
    # the first clause of the message: a timeout's "; last progress: ..." tail is the log's, not the table's
    ms = num(x.get("median_ms")) if ok else f"{x.get('status', '—')}: {failure(x.get('error')).split(';')[0]}"
    return [x["model"], x["strategy"], budget, ms,
            ratio(resident_ms / x["median_ms"] if ok and resident_ms and x.get("median_ms") else None)]


def _offload_rows(r: Result) -> list[list[str]]:
    resident = _resident_row(r)
    resident_ms = resident["median_ms"] if resident else None
    return [[*_offload_cells(x, resident_ms), num(x.get("timed_max_reserved_gib")), r.rel.rsplit("/", 1)[-1]]
            for x in r.rows("rows")
            if x.get("status") == "ok" and not (x.get("strategy") == "resident" and resident is None)]


def _planned_copies_ms(x: dict, resident: dict | None) -> float | None:
    """Host-to-card copies per forward of a streamed row's plan: the row's own, or for a row that
    did not finish, the plan the resident process made for its budget (benchmarks.offload's
    prediction: the same planner, the same card)."""
    if x.get("budget_gib") is None:
        return None
    own = (x.get("plan") or {}).get("copy_ms_per_call", {}).get("transformer")
    if own is not None:
        return own
    return ((resident or {}).get("predicted") or {}).get(str(float(x["budget_gib"])), {}).get("copy_ms")


def offload(link: Link) -> str:
    files = [load(rel) for rel in (OFFLOAD_FLUX, *OFFLOAD_I2V)]
    rows = [row for f in files for row in _offload_rows(f)]
    head = ["model", "strategy", "budget GiB", "ms / forward", "vs resident (same run)", "peak reserved GiB", "file"]
    return (table(head, rows) + "\n\nThe `diffusers` rows (group offload) ran their attention on SDPA while the "
            "resident and magi_zoo rows ran FA3: not a same-kernel comparison, so no ratio against them is claimed.\n\n"
            + sources(files, link))


def offload_families(link: Link) -> str:
    """The newer families under a 24 GiB cap: each committed run's rows, the card named, then
    the families with no run yet. Beside each streamed row, the plan's host-to-card copies per
    forward: a forward cannot be faster than its copies, so where they exceed the resident
    forward the row is bound by the link, not by the schedule. A row that did not finish is
    listed with its status (what stopped it), not left out."""
    present = {family: committed(rels) for family, rels in OFFLOAD_FAMILIES.items()}
    files = [load(rel) for rels in present.values() for rel in rels]
    rows = []
    for f in files:
        resident = _resident_row(f)
        for x in f.rows("rows"):
            ok = x.get("status") == "ok"
            rows.append([*_offload_cells(x, resident["median_ms"] if resident else None),
                         num(_planned_copies_ms(x, resident)),
                         num(x.get("timed_max_reserved_gib")) if ok else "—", f.card])
    head = ["model", "strategy", "budget GiB", "ms / forward", "vs resident (same run)",
            "planned copies, ms / forward", "peak reserved GiB", "card"]
    missing = [family for family, rels in present.items() if not rels]
    return ((table(head, rows) + "\n\n" + sources(files, link) if files else "")
            + (f"\n\nNot yet measured under the cap: {', '.join(missing)}." if missing else ""))


def training(link: Link) -> str:
    """Capped rows only: a training row counts where its process was held to its budget
    (benchmarks.train's hard cap); a row measured on the whole card is not shown -- except
    save-everything (`save_all`), the step's ceiling, labelled as uncapped: each capped row
    is also compared with it."""
    r = load(TRAIN)
    rows = [x for x in r.rows() if x.get("cap_gib") is not None]
    if not rows:
        return (f"No row of {link(r.rel)} ({r.card}, commit {r.commit}) ran under a hard memory cap, so none is "
                "shown: the training rows are measured with the process capped at its budget (docs/training.md, "
                "Measuring).")
    ceiling = next((x for x in r.rows() if x.get("strategy") == "save_all" and x.get("status") == "ok"), None)
    out = []
    for x in sorted(rows, key=lambda x: (x["cap_gib"], x["strategy"] != "eager_full" and
                                         not x["strategy"].startswith("eager_full@"))) + ([ceiling] if ceiling else []):
        ok = x.get("status") == "ok"
        to_ceiling = ceiling["ms_per_step"] / x["ms_per_step"] if ok and ceiling else None
        out.append([f"`{x['strategy']}`", num(x["cap_gib"], 0) if x.get("cap_gib") else "none (whole card)",
                    num(x.get("ms_per_step")) if ok else x.get("status", "—"),
                    ratio(x.get("speedup_vs_eager_full")) if ok and x.get("cap_gib") else "—",
                    ratio(to_ceiling) if to_ceiling else "—", num(x.get("peak_gib")),
                    num(x.get("process_peak_reserved_gib", x.get("peak_reserved_gib"))), num(x.get("estimated_peak_gib"))])
    head = [f"{r.data['model']} training step", "cap GiB", "ms / step", "vs eager + full recompute, same cap",
            "vs save everything (no cap)", "peak allocated GiB", "peak reserved GiB", "estimated peak GiB"]
    return table(head, out) + f"\n\nStep: {r.data['step']}. " + sources([r], link)


def training_multi_gpu(link: Link) -> str:
    files = [load(rel) for rel in TRAIN_MULTI]
    rows = []
    for f in files:
        single = next((x["ms_per_step"] for x in f.rows() if x.get("world") == 1), None)
        step = f.data["step"]
        optimizer = "AdamW" if "AdamW" in step else "none"
        if "CPUOffloadPolicy" in step:
            optimizer += " (shards, gradients, states on the host)"
        for x in f.rows():
            scaling = x["world"] * single / x["ms_per_step"] if single and x.get("ms_per_step") else None
            rows.append([f.data["model"], x["mode"], optimizer, str(x["world"]), num(x.get("ms_per_step")),
                         ratio(scaling) if x["world"] > 1 else "—", num(x.get("peak_gib_per_gpu")),
                         num(x.get("peak_reserved_gib_per_gpu"))])
    head = ["model", "mode", "optimizer", "GPUs", "ms / step", "throughput vs 1 GPU", "peak GiB per GPU",
            "peak reserved GiB per GPU"]
    return table(head, rows) + "\n\n" + sources(files, link)


def self_forcing(link: Link) -> str:
    """Every Self-Forcing row: the naive ports, the one-graph strategies, and the shipped
    pipeline's decode settings; each ratio against the strongest naive port of its own run."""
    files = [load(f) for f in SELF_FORCING]
    rows = []
    for f in files:
        naive = max((x["fps"] for x in f.rows() if x.get("kind") == "naive" and x.get("status") == "ok"),
                    default=None)
        for x in f.rows():
            if x.get("status") != "ok":
                continue
            rows.append([f"`{x['strategy']}`", _self_forcing_setting(f, x), num(x.get("fps")),
                         num(x.get("first_frames_s"), 3), ratio(x["fps"] / naive) if naive else "—",
                         num(x.get("transformer_ms")), num(x.get("first_video_s")), num(x.get("peak_gib")),
                         (x.get("env_commit") or f.commit)[:7]])
    shape = files[0].data["shape"]
    head = [f"{files[0].data['model']}, {shape['height']}×{shape['width']}×{shape['num_frames']}", "decode",
            "FPS", "first frames, s", "vs the strongest naive port (same run)", "transformer ms / video",
            "first video, s", "peak GiB", "commit"]
    return (table(head, rows) + "\n\nEnd to end: text encoding, every block, the streaming VAE decode. The "
            "naive ports: the original control flow compiled with `torch.compile` (`naive_compiled` on SDPA, "
            "`naive_compiled_fa3` on the FA3 kernel the fast rows use); a run without them shows no ratio.\n\n"
            + sources(files, link))


def _self_forcing_setting(f, x) -> str:
    """How a row decoded: the VAE's weight layout, on a side stream or after each block, the
    VAE passes (adapters/wan/vae.py) or the VAE as built, the first block waited for or not."""
    overlap = f.data.get("overlap_decode", False)
    parts = [f.data.get("vae_memory_format", "contiguous"), "overlapped" if overlap else "after each block"]
    if "vae" in x:
        parts.append("VAE as built" if x["vae"] == "as built" else "VAE passes")
    if overlap and "first_frames_first" in x:
        parts.append("first block first" if x["first_frames_first"] else "first block overlapped")
    return ", ".join(parts)


def vae_passes(link: Link) -> str:
    """Every `benchmarks/vae_decode.py --passes` run: the VAE as diffusers builds it beside the
    adapter's VAE passes, per dtype and op, same run; the ratio against the as-built row of the
    same op, dtype and layout; rel_err against the run's first row (fp32, as built)."""
    files = [load(p.relative_to(RESULTS).as_posix())
             for p in sorted((RESULTS / "vae_decode").glob("vae_decode_*_passes_*.json"))]
    rows = []
    for f in files:
        built = {(x["op"], x["vae_dtype"], x["layout"]): x["median_ms"] for x in f.rows()
                 if x.get("passes") == "as_built"}
        for x in f.rows():
            base = built.get((x["op"], x["vae_dtype"], x["layout"]))
            rows.append([x["model"], x["op"], "×".join(map(str, x["pixels"])), x["vae_dtype"], x["layout"],
                         x.get("passes", "as_built"), num(x["median_ms"]),
                         ratio(base / x["median_ms"]) if base else "—", f"{x['rel_err']:.2g}", f.card])
    head = ["model", "op", "pixels", "dtype", "weights", "passes", "median ms", "vs as built", "rel. error vs fp32 as built",
            "card"]
    return table(head, rows) + "\n\n" + sources(files, link)


def multi_gpu(link: Link) -> str:
    files = [load(rel) for rel in PARALLEL]
    rows = [[x["workload"], f.card, str(x["gpus"]), x["config"], num(x.get("ms")), ratio(x.get("speedup")),
             num(x.get("peak_gib"))] for f in files for x in f.rows("rows")]
    head = ["workload", "card", "GPUs", "configuration", "ms / step", "speed-up", "peak GiB"]
    return table(head, rows) + "\n\n" + sources(files, link)


def serve(link: Link) -> str:
    """Every `benchmarks/serve.py` result: a warm request against the same call in-process, and
    the throughput and latency of concurrent clients where measured."""
    files = [load(p.relative_to(RESULTS).as_posix()) for p in sorted((RESULTS / "serve").glob("serve_*.json"))]
    rows = []
    for f in files:
        x = f.data["row"]
        rows.append([x["model"], f.card, x["options"].replace("|", "\\|"), num(x["call_ms"]),
                     num(x["write_ms"]) if x.get("write_ms") else "—", num(x["generate_to_ms"]),
                     num(x["request_ms"]), f"{x['overhead_vs_generate_to_pct']:+.1f}%",
                     f"{x['overhead_vs_call_pct']:+.1f}%", str(x.get("clients", 1)),
                     num(x.get("throughput_per_s"), 3) if x.get("throughput_per_s") else "—",
                     num(x.get("p50_ms")) if x.get("p50_ms") else "—", num(x.get("p95_ms")) if x.get("p95_ms") else "—",
                     num(x["warm_compiled_frames_delta"], 0)])
    head = ["model", "card", "options", "in-process call, ms", "the file alone, ms", "call + file, ms", "request, ms",
            "request vs call + file", "request vs call",
            "clients", "requests / s", "p50 ms", "p95 ms", "frames compiled by warm requests"]
    return table(head, rows) + "\n\n" + sources(files, link)


def video_write(link: Link) -> str:
    """Every `benchmarks/video_write.py` result: the conversion and the H.264 encode per x264
    preset and threading."""
    files = [load(p.relative_to(RESULTS).as_posix()) for p in sorted((RESULTS / "serve").glob("video_write_*.json"))]
    rows = []
    for f in files:
        for x in f.data["rows"]:
            rows.append([f"{f.data['cpu_count']} cores", x["content"], f"{x['preset']}, {x['thread_type']}",
                         num(x["convert_ms"]), num(x["encode_ms"]), num(x["total_ms"]), f"{x['file_kib']:,}"])
    head = ["CPU", "content", "x264 preset, threads", "to uint8, ms", "encode, ms", "total, ms", "file KiB"]
    return table(head, rows) + "\n\n" + sources(files, link)


def fp8_checkpoint(link: Link) -> str:
    """Every `benchmarks/fp8_checkpoint.py` result: the bf16 and the fp8 checkpoint of one build,
    each loaded by `magi_zoo.load` in a fresh process -- wall seconds, the process's peak resident
    memory, the bytes the transformer and the whole pipeline hold, the files on disk; fp8 / bf16."""
    files = [load(p.relative_to(RESULTS).as_posix())
             for p in sorted((RESULTS / "fp8_checkpoint").glob("fp8_checkpoint_*.json"))]
    rows = []
    for f in files:
        by = {r["checkpoint"]: r for r in f.data["rows"]}
        for key, what in (("load_s", "`magi_zoo.load`, s"), ("touch_s", "first read of every weight, s"),
                          ("peak_rss_gib", "host peak (RSS, every weight read), GiB"),
                          ("transformer_gib", "transformer, GiB"), ("pipeline_gib", "whole pipeline, GiB"),
                          ("disk_gib", "on disk, GiB")):
            a, b = by["bf16"].get(key), by["fp8"].get(key)
            rows.append([f"`{f.data['variant']}`", what, num(a, 2), num(b, 2), ratio(b / a if a and b else None)])
    return table(["build", "what", "bf16 checkpoint", "fp8 checkpoint", "fp8 / bf16"], rows) + "\n\n" + sources(files, link)


# benchmarks.run results with a fused-LoRA row (magi_zoo_lora / magi_zoo_fp8_lora) beside its base row
LORA_RUNS = ("wan2.1-t2v-1.3b/wan2.1-t2v-1.3b_480x832x81_lora_h200.json",)


def lora_forward(link: Link) -> str:
    """A fused LoRA's forward against the same model without it, rows of one run: ms per
    forward, the ratio, and the compile counters of both (the LoRA row must compile what the
    base row does and recompile nothing); runs not yet made are listed as such."""
    present = committed(LORA_RUNS)
    rows = []
    for rel in present:
        r = load(rel)
        for x in r.rows():
            if not x["strategy"].endswith("_lora") or x.get("status") != "ok":
                continue
            base = x["strategy"].removesuffix("_lora")
            b = next((y for y in r.rows() if y.get("strategy") == base), {})  # a run may lack the base row
            slower = x["median_ms"] / b["median_ms"] - 1 if b.get("median_ms") else None
            rows.append([r.data["model"], HARNESS_NAMES.get(base, base), num(b.get("median_ms")), num(x["median_ms"]),
                         "—" if slower is None else f"{slower:+.1%}",
                         f"{b.get('frames_compiled')} / {b.get('recompiles')}",
                         f"{x.get('frames_compiled')} / {x.get('recompiles')}", (x.get("lora") or ["—"])[0]])
    if not rows:
        return "Not yet measured on a GPU (" + ", ".join(f"`{rel}`" for rel in LORA_RUNS) + ")."
    head = ["model", "base row", "base, ms / forward", "fused LoRA, ms / forward", "LoRA's cost",
            "base: frames / recompiles", "LoRA: frames / recompiles", "what was fused (the report's line)"]
    return table(head, rows) + "\n\n" + sources([load(rel) for rel in present], link)


def headline(link: Link) -> str:
    """magi_zoo against the strongest baseline measured in the same run, only where that baseline
    runs the same attention kernel (a ratio against a weaker setup is no claim); the rows still
    measured against SDPA baselines live in their topic tables, labelled."""
    wan = load(WAN_13B)
    rows = []
    for s, what in (("magi_zoo", "Wan2.1-T2V-1.3B forward, bf16"), ("magi_zoo_fp8", "Wan2.1-T2V-1.3B forward, fp8")):
        ms = wan.row(s)["median_ms"]
        name, base = strongest_baseline(wan, s)
        rows.append([what, f"{num(ms)} ms", f"{HARNESS_NAMES.get(name, name)}: {num(base)} ms",
                     f"**{ratio(base / ms)}**", wan.card.replace("NVIDIA ", ""), f"{link(wan.rel)} ({wan.commit})"])
    head = ["what", "magi_zoo", "strongest baseline (same run)", "ratio", "card", "source (commit)"]
    return table(head, rows)


GPU_LOG = re.compile(r"gputests_(?P<what>.+?)(?:_(?P<commit>[0-9a-f]{7,40}))?_(?P<card>h100|h200)(?P<gpus>x\d)?\.log")
SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ (?:passed|failed|skipped|errors?|deselected|xfailed|xpassed)"
                     r"(?:, )?)+).* in (?P<secs>[\d.]+)s", re.M)


def gpu_tests(link: Link) -> str:
    """Every committed GPU test log: what ran, on which commit and card, and pytest's own last
    summary line (counts and seconds), newest summary per file; a log without a summary (cut
    short) says so."""
    rows = []
    for path in sorted((RESULTS / "gpu_tests").glob("*.log")):
        m = GPU_LOG.fullmatch(path.name)
        if m is None:
            continue
        found = SUMMARY.findall(path.read_text(errors="replace"))
        counts, secs = found[-1] if found else ("no pytest summary (cut short, or not a pytest log)", None)
        card = m["card"].upper() + (f" ×{m['gpus'][1:]}" if m["gpus"] else "")
        rows.append([m["what"], m["commit"] or "not recorded", card, counts.strip().rstrip(","),
                     num(float(secs), 0) if secs else "—", link(f"gpu_tests/{path.name}")])
    return table(["what ran", "commit", "card", "pytest summary", "seconds", "log"], rows)


def unknown_commits(link: Link) -> str:
    """The results files whose commit is unknown: each needs re-measuring before a table uses it."""
    rows = [[link(rel), why] for rel, why in sorted(UNKNOWN_COMMITS.items())]
    return table(["results file", "why its commit is unknown"], rows)


# The tables of published configs in an adapter package: data, not adapter code.
CONFIG_MODULES = ("config.py", "configs.py")
# A family's optional kernel-fusion processors (its q/k norm + rope attention): code, shown apart
# so the contract's own part of a package is visible.
FUSION_MODULES = ("attention.py",)


def adapter_sizes(link: Link) -> str:
    """Lines of each family package under magi_zoo/adapters/: its code, and apart from it its
    modules of published config tables (`CONFIG_MODULES`); of the code, the optional fused
    attention processors (`FUSION_MODULES`) apart. Counted from the source, so the contributor
    guide's sizes are never typed by hand. Physical lines, docstrings included."""
    adapters = ROOT / "magi_zoo" / "adapters"
    rows = []
    for package in sorted(p for p in adapters.iterdir() if (p / "__init__.py").is_file()):
        files = sorted(package.glob("*.py"))
        lines = {f.name: len(f.read_text().splitlines()) for f in files}
        code = sum(n for name, n in lines.items() if name not in CONFIG_MODULES)
        tables_ = sum(n for name, n in lines.items() if name in CONFIG_MODULES)
        fused = sum(n for name, n in lines.items() if name in FUSION_MODULES)
        rows.append([f"`{package.name}`", str(len(files)), num(code, 0), num(code - fused, 0),
                     num(fused, 0) if fused else "—", num(tables_, 0) if tables_ else "—"])
    head = ["family package", "modules", "code lines", "of them: without the fused attention",
            "the fused attention (`attention.py`)", "config-table lines"]
    return table(head, rows)


TABLES: dict[str, Callable[[Link], str]] = {
    "headline": headline, "wan-1.3b": wan_13b, "wan-1.3b-fusions": wan_13b_fusions, "warm-start": warm_start,
    "flux": flux, "flux-fusions": flux_fusions, "flux-baselines": flux_baselines, "i2v-14b-loop": i2v_loop,
    "offload": offload, "offload-families": offload_families, "training": training, "training-multi-gpu": training_multi_gpu,
    "self-forcing": self_forcing, "vae-passes": vae_passes, "multi-gpu": multi_gpu, "unknown-commits": unknown_commits,
    "gpu-tests": gpu_tests, "serve": serve, "families": families,
    "video-write": video_write, "adapter-sizes": adapter_sizes, "whole-generation": whole_generation,
    "fp8-checkpoint": fp8_checkpoint, "lora-forward": lora_forward, "profile-pairs": profile_pairs,
}


# -- the docs ------------------------------------------------------------------------------------

def doc_files(root: Path = ROOT) -> list[Path]:
    """Where tables may be asked for: the README and every page under docs/."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def render(text: str, doc: Path) -> str:
    """`text` with every marked block replaced by its table, links relative to `doc`."""

    def link(rel: str) -> str:
        target = os.path.relpath(RESULTS / rel, doc.parent).replace(os.sep, "/")
        return f"[`{rel.rsplit('/', 1)[-1]}`]({target})"

    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"{doc.name}: unknown table {name!r}; tables: {', '.join(TABLES)}")
        return f"{m.group(1)}{TABLES[name](link)}\n{m.group(4)}"

    return MARKER.sub(fill, text)


def stale_blocks(root: Path = ROOT) -> list[str]:
    """'file: table' for every marked block that differs from what the generator writes."""
    out = []
    for doc in doc_files(root):
        text = doc.read_text()
        want = render(text, doc)
        if want != text:
            got = {m.group(2): m.group(3) for m in MARKER.finditer(text)}
            new = {m.group(2): m.group(3) for m in MARKER.finditer(want)}
            out += [f"{doc.relative_to(root)}: {name}" for name in new if got.get(name) != new[name]]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tables", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if any marked block is stale")
    args = p.parse_args(argv)
    if args.check:
        stale = stale_blocks()
        for s in stale:
            print(f"stale table: {s} (run: python -m benchmarks.tables)", file=sys.stderr)
        return 1 if stale else 0
    for doc in doc_files():
        text = doc.read_text()
        new = render(text, doc)
        if new != text:
            doc.write_text(new)
            print(f"wrote {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
