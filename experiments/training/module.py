"""LightningModule: a frozen backbone + an MtPC head (+ LoRA on the draft top), trained with the window loss.

Holds `MtpcTrainModule` (built from a `ModelConfig`; training/validation steps, the two-stage
schedule: head only for the first `lora_start_epoch` epochs, then head + LoRA; the loss over the
global batch under DDP and gradient accumulation; validation as sums and counts reduced across
ranks), `build_backbone`
(the `tiny` in-process Llama of `experiments.training.config.TINY_BACKBONE` for debug runs, else
`mtpc.backbones.load_backbone`).
Checkpoints hold only the trainable tensors (head + LoRA) and the RNG states; the frozen backbone
is rebuilt from its name on resume.
Leaves out: the loss maths (`mtpc.losses`), export (`mtpc.heads.save_head`), the config (config.py).
"""

from __future__ import annotations

import random
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import lightning as L
import numpy as np
import torch

from experiments.training.config import TINY_BACKBONE, ModelConfig

if TYPE_CHECKING:  # the backbones load lazily, inside build_backbone
    from mtpc.backbones.common import Backbone


def build_backbone(
    name: str, lora_depth: int, dtype: str | None = None, tiny_seed: int = 0, **kwargs: Any
) -> Backbone:
    """`tiny` -> the seeded random Llama of TINY_BACKBONE; anything else -> `load_backbone(name, ...)`.

    kwargs go to `load_backbone` (trust_remote_code, revision, lora_rank, ...); `tiny` takes the LoRA ones only.
    """
    torch_dtype = getattr(torch, dtype) if dtype else None
    if name == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        from mtpc.backbones import BackboneAdapter
        from mtpc.tokenizer import ByteTokenizer

        kwargs = {k: v for k, v in kwargs.items() if k not in ("trust_remote_code", "revision")}
        cfg = LlamaConfig(
            **TINY_BACKBONE, tie_word_embeddings=False, bos_token_id=257, eos_token_id=258, pad_token_id=256
        )
        with torch.random.fork_rng():
            torch.manual_seed(tiny_seed)
            model = LlamaForCausalLM(cfg).eval()
        if torch_dtype is not None:
            model = model.to(torch_dtype)
        return BackboneAdapter.from_hf(
            model, lora_depth=lora_depth, name="tiny", tokenizer=ByteTokenizer(), **kwargs
        )
    from mtpc.backbones import load_backbone

    return load_backbone(name, lora_depth=lora_depth, dtype=torch_dtype, **kwargs)


def input_embedding(backbone: torch.nn.Module) -> torch.Tensor | None:
    """The backbone's input embedding as (v, d) (its first v rows), or None where it has none."""
    model = getattr(backbone, "model", None)
    get = getattr(model, "get_input_embeddings", None)
    table = getattr(get(), "weight", None) if callable(get) else None
    v, d = backbone.vocab_size, backbone.hidden_size
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] < v or table.shape[1] != d:
        return None
    return table.detach()[:v]


def _is_trainable_key(key: str) -> bool:
    return key.startswith("head.") or "lora_" in key


class MtpcTrainModule(L.LightningModule):
    """Frozen backbone + MtPC head; only head (+ LoRA) parameters train.

    config: the `model` section (experiments.training.config.ModelConfig: every field is documented there);
    fields: keyword overrides of it (`MtpcTrainModule(backbone="tiny", circuit="hmm")`).
    The module reads its settings as `self.config.<field>`; the checkpoint's hyper-parameters are
    the same fields as plain values.
    """

    def __init__(self, config: ModelConfig | None = None, **fields: Any):
        super().__init__()
        from mtpc.heads import HeadConfig, MtpcHead

        c = self.config = replace(config or ModelConfig(), **fields)
        self.hidden_cache: Any = None
        """an experiments.training.hidden_cache.HiddenCache (fit.py sets it from `run.hidden_cache`; k = 0 only)"""
        self.save_hyperparameters(asdict(c), logger=False)  # MLflow params: the run description logs them
        self.strict_loading = False  # checkpoints carry head + LoRA only (see on_save_checkpoint)
        self.backbone = build_backbone(
            c.backbone,
            c.lora_depth,
            c.backbone_dtype,
            c.tiny_seed,
            trust_remote_code=c.trust_remote_code,
            revision=c.revision,
            **c.backbone_kwargs,
        )
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.lora_params = list(self.backbone.lora_parameters()) if c.lora_depth > 0 else []
        # LoRA requires grad from the start, so DDP (which registers the parameters that require grad
        # when it wraps the model) all-reduces its gradients once LoRA trains; before
        # lora_start_epoch the backbone runs without grad, so LoRA gets no gradient (None: Adam
        # leaves it and its state alone) and DDP, told so (fit.py: find_unused_parameters), skips it
        for p in self.lora_params:
            p.requires_grad_(True)
        head = HeadConfig(
            kind=c.circuit,
            window=c.window,
            rank=c.rank,
            vocab=self.backbone.vocab_size,
            hidden=self.backbone.hidden_size,
            lora_depth=c.lora_depth,
            backbone=c.backbone,
            leaf_delta_rank=c.leaf_delta_rank,
            known_byte=c.known_byte,
        )
        self.head = MtpcHead(head)
        if c.init != "random":
            W = self.backbone.mtp_unembeddings() if c.init == "mtp" else None
            if W is None:
                W = self.backbone.lm_head_weight[None]  # (1, v, d)
            self.head.init_from_unembeddings(
                W.detach().float(), noise=c.init_noise, transition_bias=c.transition_bias
            )
        if c.known_byte:  # E from the backbone's input embedding where it has one (else reset's random E)
            E = input_embedding(self.backbone)
            if E is not None:
                self.head.init_known_embedding(E.float())
        self.head.float()
        self.tokenizer = getattr(self.backbone, "tokenizer", None)

    # -- frozen backbone stays in eval mode (no dropout), LoRA switches on at lora_start_epoch --------
    def train(self, mode: bool = True) -> MtpcTrainModule:
        super().train(mode)
        self.backbone.eval()
        return self

    def lora_active(self) -> bool:
        return bool(self.lora_params) and self.current_epoch >= self.config.lora_start_epoch

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [{"params": list(self.head.parameters())}]
        if self.lora_params:
            params.append({"params": self.lora_params})
        c = self.config
        return torch.optim.Adam(params, lr=c.lr, betas=tuple(c.betas), weight_decay=c.weight_decay)

    # -- steps ------------------------------------------------------------------------------------
    def _loss(
        self,
        batch: tuple[torch.Tensor, ...],
        grad_backbone: bool,
        teacher: bool = False,
        examples: torch.Tensor | None = None,
    ):
        """The window loss; the teacher (the backbone's STP logits of the verifier top, frozen) is
        computed when distilling or when `teacher` asks for it (validation logs the KL).
        examples (n,): the per-offset example counts L_j is normalised by (None: the batch's own)."""
        from mtpc.losses import window_loss

        ids, score_mask, doc_ids = batch[:3]  # (B, S) each
        if (
            self.hidden_cache is not None and self.config.lora_depth == 0
        ):  # k = 0: the whole backbone is frozen
            from mtpc.backbones.common import SplitOutput

            h = self.hidden_cache.get(ids, lambda: self.backbone(ids).verify_hidden)  # (B, S, d)
            out = SplitOutput(verify_hidden=h, draft_hidden=h)
        else:
            with torch.set_grad_enabled(grad_backbone and torch.is_grad_enabled()):
                out = self.backbone(ids)
        e = out.draft_hidden  # (B, S, d)
        c = self.config
        logits = None
        if c.kl_beta > 0 or teacher:
            with torch.no_grad():
                logits = self.backbone.stp_logits(out.verify_hidden.detach())  # (B, S, v)
        res = window_loss(
            self.head,
            e,
            ids,
            score_mask,
            doc_ids,
            gamma=c.gamma,
            chunk_size=c.chunk_size,
            teacher_logits=logits,
            kl_beta=c.kl_beta,
            kl_temperature=c.kl_temperature,
            examples=examples,
        )
        return res, out, logits

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """The window loss over the global batch (DESIGN section 4): the loader hands every batch its
        optimizer step's per-offset example counts (all ranks, all accumulated micro-batches), so
        this rank's micro-batch contributes its share of the step's L_j; the share is multiplied by
        world_size x accumulate_grad_batches because DDP averages gradients over ranks and Lightning
        divides each micro-batch's loss by accumulate_grad_batches. The gradient is then that of the
        whole step's loss, as one process with the whole batch would compute it (same rows, same
        counts). One device, no accumulation: the counts are the batch's own, the factor 1."""
        counts = batch[3] if len(batch) > 3 else None
        res, _, _ = self._loss(batch, grad_backbone=self.lora_active(), examples=counts)
        scale = 1.0
        if counts is not None:
            scale = float(self.trainer.world_size * self.trainer.accumulate_grad_batches)
        loss = res.loss * scale
        # logged: the mean over ranks of the scaled shares (one all_reduce) = the step's loss without accumulation
        shown = (
            torch.stack(
                [
                    res.loss.detach(),
                    res.window_nll,
                    res.bits_per_byte,
                    res.window_kl if res.window_kl is not None else res.window_nll,
                ]
            ).float()
            * scale
        )
        if self.trainer.world_size > 1:
            shown = self.trainer.strategy.reduce(shown, reduce_op="mean")
        bs = batch[0].shape[0]
        self.log("train_loss", shown[0], prog_bar=True, batch_size=bs)
        self.log("train_window_nll", shown[1], batch_size=bs)
        self.log("train_bits_per_byte", shown[2], batch_size=bs)
        if res.window_kl is not None:
            self.log("train_window_kl", shown[3], batch_size=bs)
        return loss

    # -- validation: sums and counts over the epoch, reduced across ranks once at its end ----------
    def on_validation_epoch_start(self) -> None:
        n = self.config.window
        # [sum_b L_bj (n), sum_b K_bj (n), examples with a target at j (n), sum of stp per-example NLL, its count]
        self._val_sums = torch.zeros(3 * n + 2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        n = self.config.window
        ones = torch.ones(n, device=batch[0].device)
        res, out, logits = self._loss(
            batch, grad_backbone=False, teacher=True, examples=ones
        )  # per-example sums
        sums = self._val_sums
        sums[:n] += res.per_position_nll.double()
        sums[n : 2 * n] += res.per_position_kl.double()
        sums[2 * n : 3 * n] += res.examples.double()
        stp = stp_nll(logits, *batch[:3], reduce=False)
        if stp is not None:
            sums[3 * n] += stp.double().sum()
            sums[3 * n + 1] += stp.numel()

    def on_validation_epoch_end(self) -> None:
        """Per-offset means over every held-out example with a target there, L_j = sum / count (the
        same number whatever the batch size or the number of ranks), logged by every rank alike."""
        import math

        from mtpc.losses import default_gamma

        c, n = self.config, self.config.window
        sums = self._val_sums
        if self.trainer.world_size > 1:
            sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        counts = sums[2 * n : 3 * n].clamp(min=1)
        nll, kl = sums[:n] / counts, sums[n : 2 * n] / counts
        gamma = default_gamma(n) if c.gamma is None else float(c.gamma)
        discount = gamma ** torch.arange(n, dtype=torch.float64, device=sums.device)
        beta = float(c.kl_beta)
        s = 1 if c.known_byte else 0  # a known-byte head scores positions 2..n: val_nll_1 / val_kl_1 are NaN
        nll[:s], kl[:s] = float("nan"), float("nan")
        values = {
            "val_loss": (discount * ((1 - beta) * nll + beta * kl))[s:].sum(),
            "val_window_nll": nll[s:].sum(),
            "val_bits_per_byte": nll[s:].sum() / (n - s) / math.log(2),
            "val_window_kl": kl[s:].sum(),
        }
        values.update({f"val_nll_{j}": v for j, v in enumerate(nll, start=1)})
        values.update({f"val_kl_{j}": v for j, v in enumerate(kl, start=1)})
        if sums[3 * n + 1] > 0:  # the same on every rank after the reduction: all log it or none
            values["val_stp_nll"] = sums[3 * n] / sums[3 * n + 1]
        for key, v in values.items():
            self.log(key, v.float(), prog_bar=key == "val_loss", sync_dist=self.trainer.world_size > 1)

    # -- checkpoints: trainable tensors + RNG states only -----------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if _is_trainable_key(k)}
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        checkpoint["rng_states"] = {  # plain types and tensors only: Lightning loads with weights_only
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        want = {k for k in self.state_dict() if _is_trainable_key(k)}
        missing = want - set(checkpoint["state_dict"])
        if missing:
            raise ValueError(
                f"checkpoint lacks {len(missing)} trainable tensors, e.g. {sorted(missing)[:3]}: "
                "was it written for another circuit, window, rank or lora_depth?"
            )
        rng = checkpoint.get("rng_states")
        if rng:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            kind, keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def stp_nll(
    logits: torch.Tensor,
    ids: torch.Tensor,
    score_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    reduce: bool = True,
) -> torch.Tensor | None:
    """The backbone's own next-byte NLL (nats) on the scored targets, per-example mean then batch mean
    (reduce=False: the per-example means of the examples with a scored target).

    Same normalisation as the window loss at position 1, so it is the floor a head's val_nll_1 can reach.
    """
    from mtpc.losses import next_byte_nll

    flat, present = next_byte_nll(logits, ids, doc_ids)  # (P,), (B, S-1)
    valid = present & score_mask[:, 1:]  # (B, S-1)
    nll = (
        torch.zeros(present.shape, dtype=flat.dtype, device=flat.device).masked_scatter_(present, flat)
        * valid
    )
    count = valid.sum(-1)
    keep = count > 0
    if not keep.any():
        return None
    per_example = nll.sum(-1)[keep] / count[keep]
    return per_example.mean() if reduce else per_example
