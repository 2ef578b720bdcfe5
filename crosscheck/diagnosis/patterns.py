"""The known bug patterns of docs/bugs.md: what each buggy step computes, and where it runs.

This module is the contract between the buggy training steps of the two frameworks
(``torch_impl.harness.bugs``, ``jax_impl.harness.bugs``) and the diagnosis
(``crosscheck.diagnosis.diagnose``): it says in words what every pattern does to the normalization,
and which fixtures and layouts the catalogue runs it on. It holds no math: the diagnosis predicts
each pattern's gradient from the oracle in numpy, and each framework writes its buggy loop in its
own idiom, so a mistake in one does not hide in the other.

Every buggy step runs **two accumulation windows** (optimizer updates) on the same global batch
with the same params and no optimizer step in between, and reports the second window's
synchronized gradient, as the optimizer would receive it, plus the denominator the step would
log for that window. Only ``stale-count`` makes the two windows differ.

Notation (one window): R ranks, M microbatches per rank, D the intended global denominator,
``n_r`` / ``n_rm`` the valid targets of a rank / microbatch, N rows of T slots.

Why one file: the catalogue is one table, a record per pattern in the order of docs/bugs.md, read
top to bottom as that table is; its reader and the run records sit beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

from crosscheck.contract.layout import Layout

#: Threshold of the clip-per-microbatch runs: on both catalogue runs one accumulation step's
#: token-mean gradient exceeds it (step norms 0.179 and 0.225 on packed at (2, 2), 0.173 and
#: 0.108 on ragged at (1, 2)), so the clipping bites; the JAX catalogue test asserts it does.
CLIP_PER_MICROBATCH_NORM = 0.15

#: Windows each buggy step runs; the second one is diagnosed (stale-count needs two).
NUM_WINDOWS = 2


class PatternRun(NamedTuple):
    """A fixture and layout the catalogue runs a pattern on: R data-parallel ranks, M
    microbatches, C context-parallel ranks in `context_order` (1: none), and the model cut
    into `pipeline_stages` stages (1: none)."""

    fixture: str
    world_size: int
    accum_steps: int
    context_size: int = 1
    context_order: str = "contiguous"
    pipeline_stages: int = 1

    def __str__(self) -> str:
        extra = ""
        if self.context_size > 1:
            extra = f", {self.context_size} {self.context_order}"
        elif self.pipeline_stages > 1:
            extra = f", {self.pipeline_stages} stages"
        return f"{self.fixture} ({self.world_size}, {self.accum_steps}{extra})"


#: The catalogue's pipeline cut of the bilinear model: stage 0 holds the embedding, stage 1 the
#: unembedding, the labels and the loss (``torch_impl.pipeline``, ``jax_impl.pipeline``).
PIPELINE_STAGE_PARAMS: tuple[tuple[str, ...], ...] = (("embed",), ("unembed",))


@dataclass(frozen=True, kw_only=True, slots=True)
class BugPattern:
    """One row of docs/bugs.md."""

    id: str
    #: The scheme the user meant; the diagnosis measures the step against it.
    intended: str
    #: Upstream references, for docstrings and reports.
    upstream: str
    #: What the buggy step computes, precisely enough to implement it independently.
    step: str
    #: What the step logs as its denominator for the diagnosed (second) window.
    logged_denominator: str
    #: The fix, in the user's terms: what to count, where to reduce it, what to divide by
    #: (torch's words; `jax_fix` where JAX's cause or remedy differs).
    fix: str
    #: The fix in a JAX step's terms, where it is not `fix`'s ("" when it is).
    jax_fix: str = ""
    #: The shape of the error against the intended weights: "scale" (every token weighted
    #: alike, the gradient scaled), "rank" (a factor per rank), "microbatch" (a factor per
    #: rank and microbatch) or "other". A reweighting pattern is only named where a plain
    #: scale does not explain the gradient as well (see `crosscheck.diagnosis.naming`).
    signature: str = "scale"
    #: Frameworks where the pattern exists.
    frameworks: tuple[str, ...] = ("torch", "jax")
    #: Where the catalogue runs it: layouts where no other pattern predicts the same gradient
    #: and log.
    runs: tuple[PatternRun, ...] = field(default_factory=tuple)


#: The catalogue, one record per pattern in the order of docs/bugs.md: the pattern's id at the
#: margin, then its `BugPattern` fields indented by four (``logged denominator`` is the field
#: `logged_denominator`; a record without ``signature`` is "scale"; ``runs`` lists fixture
#: (R, M), fixture (R, M, C order) under context parallel, or fixture (R, M, S stages) for
#: a pipeline); a line indented deeper
#: continues the field above it, a ``# `` line is a comment,
#: and ``{clip_norm}`` stands for CLIP_PER_MICROBATCH_NORM. Kept as text because it is a
#: table: records of the same fields read best as the table docs/bugs.md shows.
_CATALOGUE = """
rank-mean
    intended: token_mean
    signature: rank
    runs: seed (2, 1), ragged (4, 1)
    upstream: seed example; torchtune#2980; prime-rl#2358
    step: each rank divides the sum of its valid-token losses over all its microbatches by its
        own valid count n_r; the gradient all-reduce averages the R ranks
    logged denominator: n_r of the rank (rank 0's is reported)
    fix: count the valid tokens of the whole update on every rank first (one all-reduce of the
        local count, before any backward), divide each rank's summed loss by that global count
        and multiply by R for DDP's averaging (or reduce gradients with a sum)
    jax fix: count the valid tokens of the whole update first (a psum of each device's count,
        from the labels, before any gradient), divide each device's summed loss by that global
        count and multiply by R when the gradient is reduced with pmean (or reduce it with psum)

microbatch-mean
    intended: token_mean
    signature: microbatch
    runs: packed (2, 2), ragged (2, 2)
    upstream: transformers#34191; nanoGPT; T5X microbatches; Levanter MEAN; optax.MultiSteps
        with a mean loss
    step: each microbatch takes its own token mean (sum / n_rm), divided by M for accumulation;
        the all-reduce averages the R ranks
    logged denominator: n_rm of rank 0's last microbatch
    fix: do not average per-microbatch means: sum each microbatch's token losses
        (reduction="sum") and divide by the valid tokens of the whole accumulation window on all
        ranks, counted before the first backward (times R under DDP's averaging)
    jax fix: do not average per-micro-step means: each micro-step's summed token loss over the
        valid tokens of the whole accumulation window on all devices, counted before the first
        micro-step (optax.MultiSteps averages the micro-steps' gradients: hand it summed losses
        over the window's count, or accumulate token-weighted as jax_impl does)

microstep-mean
    intended: token_mean
    signature: microbatch
    # R > 1 and M > 1, where the ranks' counts differ inside a microbatch and the global
    # microbatches' counts differ: at R = 1 it is microbatch-mean, at M = 1 the intended token
    # mean, and where every rank of each microbatch holds the same count it is microbatch-mean.
    runs: packed (2, 2), ragged (2, 2)
    upstream: optax.MultiSteps(use_grad_mean=True) with a mean loss under jit over a globally
        sharded batch (the optax gradient accumulation guide); transformers#34191 (its per-rank
        cousin)
    step: each accumulation microbatch m takes its token mean over all ranks, sum / n_m with
        n_m = sum_r n_rm (the microbatch's count all-reduced before its backward), divided by M
        for accumulation; the gradient reduction is correct (a sum, or x R under DDP's
        averaging): token t of microbatch m weighs v_t / (M n_m)
    logged denominator: n_m of the last microbatch (all ranks)
    fix: count the valid tokens of the whole accumulation window (all M microbatches, all
        ranks) once, before the first micro-step, and divide every microbatch's summed loss by
        that count instead of by its own microbatch's (times R under DDP's averaging; in optax,
        MultiSteps(use_grad_mean=False) with each micro-step's summed loss over the window's
        count)

missing-world-size
    intended: token_mean
    runs: packed (2, 1), ragged (4, 1)
    upstream: transformers#37474
    step: every microbatch loss is sum / D with the correct global D, but the gradient
        all-reduce averages (divides by R) and nobody multiplied by R
    logged denominator: D
    fix: DDP and pmean average the gradient over the R ranks: multiply the loss by R after
        dividing by the global count, or reduce the gradient with a sum
    jax fix: pmean averages the gradient over the R devices: multiply the loss by R after
        dividing by the global count, or reduce the gradient with psum

double-world-size
    intended: token_mean
    runs: packed (2, 1), ragged (4, 2)
    upstream: liquid-finetune#38; transformers#48690
    step: sum / D, multiplied by R by the user and by R again by a wrapper, under an averaging
        all-reduce: the gradient is R times the intended one
    logged denominator: D
    fix: multiply by R exactly once: either your loss does it or the wrapper does (look for a
        trainer setting that rescales the loss by the world size)
    jax fix: multiply by R exactly once: inside shard_map the gradient of replicated params is
        already summed over the devices by autodiff, so a psum (or a loss scaled by R) on top
        counts every rank R times; cast the params to rank-varying first
        (jax.lax.pcast(params, ("data",), to="varying")) or drop the extra factor

double-accum-scale
    intended: token_mean
    runs: packed (1, 2), ragged (2, 4)
    upstream: transformers#35438
    step: sum / D under a correct reduction, but every microbatch loss is multiplied by M (the
        accumulation count) once too often: the gradient is M times too big
    logged denominator: D
    fix: the global count already covers all M microbatches: do not multiply the loss by the
        accumulation steps as well

double-accum-divide
    intended: token_mean
    # M = 4 with R != M: at R = M its 1/M is missing-world-size's 1/R, and at M = 2 its 1/2
    # is stale-count's (which logs 2 D).
    runs: packed (1, 4), ragged (2, 4)
    upstream: ms-swift#10117
    step: sum / D under a correct reduction, but every microbatch loss is divided by M (the
        accumulation count) once more, as if D were a per-microbatch count: the gradient is 1/M
        of the intended one
    logged denominator: D
    fix: the global count already covers all M microbatches: do not divide the loss by the
        accumulation steps as well (a trainer dividing by gradient_accumulation_steps on top of
        a num_items_in_batch normalization)

unshifted-count
    intended: token_mean
    runs: packed (2, 2), ragged (2, 1)
    upstream: transformers#46204
    step: the denominator counts labels before the causal shift: D + (number of rows with at
        least one valid target), one extra label per row; the loss sums are right
    logged denominator: D + rows with a valid target
    fix: count the labels after the causal shift (the targets that get a loss, labels[..., 1:]
        != -100), not before it

attention-mask-count
    intended: token_mean
    runs: multimodal (2, 1), packed (2, 2)
    upstream: unsloth-zoo#1217; multimodal trainers
    step: the denominator counts attended positions (segment_ids > 0: prompt, image placeholders
        and document ends included) instead of valid targets
    logged denominator: attended positions of the global batch
    fix: count the tokens with a loss (targets != -100), not attended positions
        (attention_mask): prompts, image placeholders and document ends attend but carry no loss

clip-per-microbatch
    intended: token_mean
    signature: microbatch
    runs: packed (2, 2), ragged (1, 2)
    upstream: transformers#986; gpt-jax#2 (optax.apply_every)
    step: correct sum / D losses, but each accumulation step's synchronized gradient (all ranks'
        microbatch m) is clipped to global norm {clip_norm} before it is added to the
        accumulator
    logged denominator: D
    fix: clip once per update, after the last microbatch's backward and the gradient all-reduce
        (clip_grad_norm_ after accumulation; in optax, clip inside the inner optimizer of
        MultiSteps)

stale-count
    intended: token_mean
    runs: packed (1, 2), ragged (4, 1)
    upstream: torchtune#1917 (review)
    step: the global valid-token counter is not reset between windows: the second window divides
        by D + D
    logged denominator: 2 D
    fix: reset the token counter at the start of every optimizer update

double-reduce-count
    intended: token_mean
    # R = 4: at R = 2 its 1/2 and its log 2 D are stale-count's too.
    runs: packed (4, 2), ragged (4, 1)
    upstream: Megatron-LM#7481
    step: the local count is all-reduced in place into a buffer that is all-reduced again: the
        count is R D, the gradient R times too small
    logged denominator: R D
    fix: all-reduce the local count exactly once, into a fresh tensor, not in place on a buffer
        that is reduced again

packed-as-one
    intended: sequence_mean
    signature: other
    runs: packed (2, 1), packed-wide (2, 2)
    upstream: packing collators; functionary#265
    step: the per-sequence mean is taken per packed row: every segment of a row shares the row's
        valid count, and D counts rows with a valid target
    logged denominator: rows with a valid target
    fix: take the per-sequence mean per document: group tokens by (row, segment id), not by row,
        and count documents, not rows

padding-as-tokens
    intended: token_mean
    runs: packed (2, 1), ragged (2, 2)
    upstream: T5X NUM_TOTAL_TARGET_TOKENS vs NUM_REAL_TARGET_TOKENS
    step: the denominator counts every target slot, padding and ignored ones included: N T
    logged denominator: N T
    fix: divide by the tokens that carry a loss (NUM_REAL_TARGET_TOKENS), not by every target
        slot; or verify against constant if a fixed normalizer is what you mean

float32-count
    intended: weighted_mean
    runs: dedup-seed (2, 1), dedup-packed (2, 2)
    upstream: large-batch pretraining
    step: the weighted-mean denominator (integer token multiplicities summing past 2^24) is
        accumulated and all-reduced in float32; losses stay float64
    logged denominator: the float32 denominator
    fix: accumulate and all-reduce the denominator as an int64 count or in float64 (or carry it
        exactly, torch_impl.exact_carry), never in float32 past 2^24
    jax fix: carry the denominator as an integer count (int32, psum'd) or in float64
        (jax_enable_x64), never as a float32 sum past 2^24

local-group-count
    intended: group_token_mean
    signature: other
    # Layouts where a prompt group of rollouts is split: group 0 over microbatches at (1, 2),
    # groups 0 and 1 over ranks and microbatches at (2, 2), every group over ranks at (4, 1).
    # rollouts is the one built-in fixture with prompt groups, hence three layouts of it.
    runs: rollouts (1, 2), rollouts (2, 2), rollouts (4, 1)
    upstream: slime per-rollout means; verl#2776; SkyRL prompt_mean computed per microbatch
    step: each microbatch counts a prompt group's valid tokens on its own rows only: token t
        weighs v_t / n_group,local(t), n_group,local the valid targets of t's group inside t's
        (rank, microbatch); D, the non-empty prompt groups of the whole update, is right and the
        gradient reduction is correct
    logged denominator: D (non-empty groups of the update)
    fix: count each group's valid tokens over the whole update before any backward: a vector of
        per-group counts summed over the rank's microbatches and all-reduced once, then
        a_t = v_t / n_group(t) with that global count

zero-count-nan
    intended: token_mean
    signature: other
    # A microbatch with no valid target: rollouts at (4, 2) holds row 5 alone, empty-rank
    # at (2, 1) has a whole rank of rows without a loss.
    runs: rollouts (4, 2), empty-rank (2, 1)
    upstream: mcore-bridge#104; Megatron-LM#3396; verl#6464; prime-rl#808; NeMo-RL#212
    step: each microbatch takes its own token mean with a loss mask, sum(l_t m_t) / sum(m_t),
        divided by M, ranks averaged, without a guard: a microbatch with n_rm = 0 computes
        0 / 0 = NaN, its backward multiplies the mask by 1/0 (0 x inf = NaN), and the gradient
        all-reduce puts NaN on every rank (all of the unembedding, the embedding rows it reads)
    logged denominator: n_rm of rank 0's last microbatch
    fix: never divide by a local count that can be 0: normalize by the global count of the
        update (counted before the first backward), or guard an empty microbatch or rank so it
        adds 0 (max(n, 1), or skip its backward while still joining the collectives)

cp-local-count
    intended: token_mean
    signature: rank
    # Context parallel only (C > 1; at C = 1 it is rank-mean). Contiguous packed rows put
    # 199 valid targets on the first process and 32 on the second.
    runs: packed (1, 1, 2 contiguous), ragged (2, 1, 2 zigzag), packed (1, 2, 4 zigzag)
    upstream: Megatron-LM#7513 (#7452 finding 9); verl#6836 guard
    step: under context parallel each process (data rank r, context rank c) divides the loss
        sum of its shard of the rows over all its microbatches by its own shard's valid count
        n_p (clamped to 1 when empty, as Megatron does); the gradient all-reduce averages the
        R C processes: token t of process p weighs v_t / (R C n_p). With one valid token,
        C = 2 halves its gradient and C = 4 quarters it
    logged denominator: n_p of process 0
    fix: count the valid tokens of the whole update over all R C processes (one all-reduce of
        each shard's count over the data and context group, before any backward), divide each
        shard's summed loss by that count and multiply by R C for the averaging all-reduce
    jax fix: count the valid tokens of the whole update first (a psum of each shard's count
        over both the data and the context axes), divide each shard's summed loss by it and
        reduce the gradient with psum over both axes

cp-count-over-replicas
    intended: token_mean
    # C = 4 and R = 1: at C = 2 its 1/2 and its log 2 D are stale-count's, and at R = C the
    # log R D is double-reduce-count's.
    runs: packed (1, 1, 4 zigzag), ragged (1, 2, 4 contiguous)
    upstream: verl#3691 (sequence-parallel ranks counted twice); prime-rl#2359 (review: a sum
        over dp_cp of identical microbatches)
    step: every process counts the valid targets of its whole rows (the labels before the
        context split, which every context rank of a row holds), then all-reduces that count
        over all R C processes: the C context ranks of a row count it C times, D' = C D; each
        shard's loss sum is divided by D' under a correct reduction: the gradient is 1/C of
        the intended one
    logged denominator: C D
    fix: reduce a count of whole rows over the data-parallel group only (the context ranks of
        a row hold replicas of its labels), or count each shard's own targets and reduce over
        data and context together: every target counted once
    jax fix: psum a count of whole rows over the data axis only, or a count of each shard's
        own targets over the data and context axes together: every target counted once

cp-count-over-dp-only
    intended: token_mean
    signature: other
    # Contiguous order, where the context ranks' shares of the targets differ most (packed:
    # 199 against 32 at C = 2).
    runs: packed (2, 1, 2 contiguous), ragged (1, 2, 2 contiguous), packed (1, 1, 4 contiguous)
    upstream: verl#5993 and verl#5983 (context-parallel undercount); prime-rl#2359 (a count
        reduced over a group that misses the context ranks)
    step: each process counts its own shard's valid targets and all-reduces the count over
        the data-parallel group only (the processes of its context rank c), D_c = sum_r n_rc;
        its shard's loss sum is divided by D_c under a correct reduction (a sum over the R C
        processes, or their average times R C): token t on context rank c
        weighs v_t / D_c, about C times the intended weight, more on the ranks with fewer
        targets
    logged denominator: D_0 (context rank 0's)
    fix: reduce the count over the data and context group together (Megatron's dp_cp group),
        or count whole rows before the context split and reduce over the data group alone
    jax fix: psum each shard's count over both the data and the context axes, or count
        whole rows before the context split and psum over the data axis alone

missing-cp-compensation
    intended: token_mean
    # R = 1 with M = 1: at R > 1 missing-world-size may coincide, at M = 2 and C = 2
    # double-accum-divide does. The log (D) tells it from cp-count-over-replicas (C D).
    runs: packed (1, 1, 2 zigzag), ragged (1, 1, 4 contiguous)
    upstream: slime#990; Megatron-LM#673
    step: the correct global count D over all R C processes, each shard's loss sum divided by
        D and multiplied by R against the data-parallel average, but the gradient all-reduce
        averages over the R C processes and nobody multiplied by C: the gradient is 1/C of
        the intended one
    logged denominator: D
    fix: an averaging all-reduce over data and context ranks divides by R C: multiply the
        loss by R C (not R), or reduce the gradient over the context group with a sum
    jax fix: pmean over the data and context axes divides by R C: multiply the loss by R C, or
        reduce with psum over both axes

cp-local-sequence-count
    intended: sequence_mean
    signature: other
    # Packed documents cross the context split; (1, 1) keeps every other pattern's units
    # whole, so only the split differs from the intended sequence mean.
    runs: packed (1, 1, 2 contiguous), packed-wide (2, 1, 2 zigzag), packed (1, 2, 4 zigzag)
    upstream: verl (seq-mean-token-mean rejected under context parallel: "per-sequence inner
        division by n_s requires local-shard counts that diverge from global under CP");
        verl#6836
    step: each process counts a document's valid targets on its own shard of the row only:
        token t weighs v_t / (n_seg,local(t) D), n_seg,local the valid targets of t's (row,
        segment) inside t's process and microbatch; D, the documents with a valid target in
        the whole update, is right and the gradient reduction is correct
    logged denominator: D (documents with a valid target)
    fix: count every document's valid targets over the whole row before the context split (or
        sum the shard counts over the context group) and divide by that count

pp-unsent-count
    intended: token_mean
    signature: other
    # A pipeline of 2 stages (embed; unembed and the loss); nothing but a stage's parameters
    # scaled apart from the others' predicts it.
    runs: packed (1, 2, 2 stages), ragged (2, 2, 2 stages)
    upstream: torchtitan#4194 (Forge: pipeline gradients inflated by global_valid_tokens);
        torchtitan#2972 (pipeline vs non-pipeline gradient scale)
    step: the model is cut into pipeline stages and only the last holds the labels and the
        loss; the loop backpropagates the unnormalized sums through the schedule (1F1B) and
        divides by D afterwards, but D is known on the last stage only and never sent down
        the pipeline: the last stage's gradient is right, every earlier stage's is the
        unnormalized sum, D times its intended gradient (the logged loss is right)
    logged denominator: D (on the last stage)
    fix: send D from the last stage to every stage of its pipeline before they divide (or
        divide the loss by D before the schedule's backward, so the scale travels back with
        the activations' gradients)
"""

#: "name (R, M)", "name (R, M, C order)" or "name (R, M, S stages)" of a ``runs`` line.
_RUN = re.compile(r"([\w-]+) \((\d+), (\d+)(?:, (\d+) (contiguous|zigzag|stages))?\)")


def _read_catalogue(text: str) -> dict[str, BugPattern]:
    """The BugPatterns of `text` (written as `_CATALOGUE` is), by id, in order.

    An unknown field is a TypeError and a runs line that does not read is a ValueError, at
    import: a typo in the catalogue cannot pass for a pattern.
    """
    records: list[dict[str, str]] = []
    key = ""
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        words = line.strip()
        if not words or words.startswith("# "):
            continue
        if indent == 0:
            records.append({"id": words})
        elif indent == 4:
            name, _, value = words.partition(": ")
            key = name.replace(" ", "_")
            records[-1][key] = value
        else:
            records[-1][key] += " " + words
    patterns = {}
    for record in records:
        runs = record.pop("runs")
        parsed = tuple(
            PatternRun(name, int(R), int(M), int(C), order)
            if order in ("contiguous", "zigzag")
            else PatternRun(name, int(R), int(M), pipeline_stages=int(C or 1))
            for name, R, M, C, order in _RUN.findall(runs)
        )
        if ", ".join(map(str, parsed)) != runs:
            raise ValueError(f"catalogue record {record['id']}: cannot read runs {runs!r}")
        patterns[record["id"]] = BugPattern(runs=parsed, **record)
    return patterns


PATTERNS: dict[str, BugPattern] = _read_catalogue(
    _CATALOGUE.replace("{clip_norm}", str(CLIP_PER_MICROBATCH_NORM))
)

#: A step that is correct except that rank 0's loss is multiplied by `skew`: it measures the
#: smallest distortion verification flags (not a pattern of docs/bugs.md).
RANK_SKEW = "rank-skew"


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class BugRun:
    """One buggy step of one framework on one fixture and layout."""

    pattern: str  # a PATTERNS id, or RANK_SKEW
    framework: str  # "torch" or "jax"
    fixture: str
    world_size: int
    accum_steps: int
    dtype: str = "float64"
    skew: float = 1.0  # rank-skew only
    #: Context-parallel ranks per data-parallel rank, and the order they split a row in.
    context_size: int = 1
    context_order: str = "contiguous"
    #: Pipeline stages each data-parallel rank's model is cut into (`PIPELINE_STAGE_PARAMS`).
    pipeline_stages: int = 1

    @property
    def layout(self) -> Layout:
        return Layout(self.world_size, self.accum_steps, self.context_size, self.context_order)

    @property
    def num_processes(self) -> int:
        """R C S: every data-parallel rank's context ranks and stages are processes."""
        return self.world_size * self.context_size * self.pipeline_stages

    @property
    def where(self) -> str:
        """The layout as the catalogue table shows it (R=2,M=1,C=2z; R=1,M=2,S=2)."""
        stages = f",S={self.pipeline_stages}" if self.pipeline_stages > 1 else ""
        return f"{self.layout}{stages}"

    def describe(self) -> str:
        skew = f" skew={self.skew}" if self.pattern == RANK_SKEW else ""
        extra = ""
        if self.context_size > 1:
            extra = f" C={self.context_size} {self.context_order}"
        if self.pipeline_stages > 1:
            extra += f" S={self.pipeline_stages}"
        return (
            f"{self.pattern} ({self.framework}) {self.fixture} "
            f"R={self.world_size} M={self.accum_steps}{extra} {self.dtype}{skew}"
        )


@dataclass(frozen=True, slots=True)
class BugOutput:
    """What a buggy step produced for its second window."""

    #: The synchronized gradient as the optimizer receives it, float64 numpy, checked equal
    #: on every rank.
    grads: dict
    #: The denominator the step logs (see BugPattern.logged_denominator); None if it has none.
    logged_denominator: float | None


def catalogue_runs(frameworks: tuple[str, ...] = ("torch", "jax")) -> list[BugRun]:
    """Every (pattern, framework, fixture, layout) of the catalogue, float64."""
    return [
        BugRun(
            pattern=p.id,
            framework=fw,
            fixture=run.fixture,
            world_size=run.world_size,
            accum_steps=run.accum_steps,
            context_size=run.context_size,
            context_order=run.context_order,
            pipeline_stages=run.pipeline_stages,
        )
        for p in PATTERNS.values()
        for fw in frameworks
        if fw in p.frameworks
        for run in p.runs
    ]
