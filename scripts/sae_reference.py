"""SAEs made by sae-lens itself on the trained fixture, and the TransformerLens model each was trained on: the
reference the engine's SAE support is checked against (tests/test_sae.py, scripts/bench_sae.py).

    python scripts/sae_reference.py OUT    # what scripts/fixtures.py runs for its "saes" entry

Each SAE is sae-lens's own class, fitted for a few hundred Adam steps to activations that TransformerLens's
HookedSAETransformer computes with the SAE's model options (center_writing_weights, fold_value_biases, fold_ln),
then written by sae-lens's save_model; the OpenAI-format file is an SAELens TopK SAE with OpenAI's settings
(layer_norm input, no decoder-norm rescale) written as that repository's Autoencoder.state_dict() writes itself.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

D_SAE_PER_D_IN = 4


@dataclass(frozen=True)
class Spec:
    name: str
    architecture: str
    hook: str
    options: dict[str, bool] = field(default_factory=dict)  # model_from_pretrained_kwargs
    extra: dict[str, Any] = field(default_factory=dict)  # SAELens config fields


SPECS = (
    Spec("standard-resid", "standard", "blocks.1.hook_resid_pre", {"center_writing_weights": True}),
    Spec("topk-mlp", "topk", "blocks.2.hook_mlp_out", {}, {"k": 24, "normalize_activations": "layer_norm"}),
    Spec("jumprelu-resid", "jumprelu", "blocks.3.hook_resid_post"),
    Spec("z", "standard", "blocks.1.attn.hook_z", {"fold_value_biases": True}, {"reshape_activations": "hook_z"}),
    Spec("gated-ln", "gated", "blocks.2.ln2.hook_normalized", {"fold_ln": True}),
    Spec("standard-lnf", "standard", "ln_final.hook_normalized", {"fold_ln": True, "center_writing_weights": True}),
    Spec("head", "standard", "blocks.2.attn.hook_z", {"fold_value_biases": True}, {"hook_head_index": 1}),
)
OPENAI = Spec("openai-topk", "topk", "blocks.3.hook_resid_mid", {},
              {"k": 32, "normalize_activations": "layer_norm", "rescale_acts_by_decoder_norm": False})


def tl_model(hf_model, **options: bool):
    """The trained fixture as TransformerLens's HookedSAETransformer, loaded with `options` as
    from_pretrained_no_processing(..., **options) would (every processing flag False unless given)."""
    from sae_lens import HookedSAETransformer
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

    c = hf_model.config
    cfg = HookedTransformerConfig(
        n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.n_positions, d_head=c.n_embd // c.n_head, n_heads=c.n_head,
        d_mlp=4 * c.n_embd, d_vocab=c.vocab_size, act_fn="gelu_new", normalization_type="LN",
        eps=c.layer_norm_epsilon, positional_embedding_type="standard", original_architecture="GPT2LMHeadModel",
        default_prepend_bos=False)
    model = HookedSAETransformer(cfg)
    flags = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
    flags.update(options)
    model.load_and_process_state_dict(convert_gpt2_weights(hf_model, cfg), **flags)
    return model.eval()


def docstring_ids(tokenizer, windows: int, length: int, skip: int = 0) -> torch.Tensor:
    """[windows, length] token ids of the standard library's docstrings (the trained fixture's kind of text)."""
    import collections, email, json as json_module, pathlib, textwrap  # noqa: E401

    text = "\n\n".join(inspect.getdoc(o) or "" for m in (collections, email, json_module, pathlib, textwrap, inspect)
                       for o in [m, *vars(m).values()] if callable(o) or inspect.ismodule(o))
    ids = tokenizer.encode(text)
    need = (skip + windows) * length
    ids = (ids * (need // len(ids) + 1))[skip * length : need]
    return torch.tensor(ids).view(windows, length)


def activations(model, spec: Spec, ids: torch.Tensor) -> torch.Tensor:
    """[N, d_in]: the SAE's input rows at its hook, as TransformerLens shows them."""
    _, cache = model.run_with_cache(ids, names_filter=[spec.hook])
    a = cache[spec.hook]
    if "hook_head_index" in spec.extra:
        a = a[:, :, spec.extra["hook_head_index"]]
    elif a.dim() == 4:
        a = a.flatten(-2)
    return a.reshape(-1, a.shape[-1])


def make_sae(spec: Spec, x: torch.Tensor, heads: int, steps: int = 300, seed: int = 0):
    """sae-lens's SAE of `spec`'s architecture, fitted to the rows x [N, d_in] (MSE, plus an L1 penalty where the
    architecture is not top-k)."""
    from sae_lens.registry import get_sae_class
    from sae_lens.saes.sae import SAEMetadata

    torch.manual_seed(seed)
    d_in = x.shape[1]
    fields = {"d_in": d_in, "d_sae": D_SAE_PER_D_IN * d_in,
              **{k: v for k, v in spec.extra.items() if k != "hook_head_index"}}
    sae_class, config_class = get_sae_class(spec.architecture)
    config = config_class(**fields)
    config.metadata = SAEMetadata(hook_name=spec.hook, hook_head_index=spec.extra.get("hook_head_index"),
                                  model_name="trained-fixture", model_from_pretrained_kwargs=dict(spec.options),
                                  prepend_bos=False, context_size=64)
    sae = sae_class(config)
    with torch.no_grad():  # start the decoder at a sample of the data's directions, the encoder at its transpose
        rows = x[torch.randperm(x.shape[0])[: config.d_sae]]
        sae.W_dec.copy_(torch.nn.functional.normalize(rows - x.mean(0), dim=-1) * 0.5)
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_dec.copy_(x.mean(0))
    params = [p for p in sae.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=2e-3)
    scale = x.pow(2).sum(-1).mean()
    for step in range(steps):
        batch = x[torch.randint(0, x.shape[0], (512,))]
        if spec.extra.get("reshape_activations") == "hook_z":  # sae-lens flattens [..., nh, hs] itself
            batch = batch.view(512, heads, -1)
        f = sae.encode(batch)
        loss = (sae.decode(f) - batch).pow(2).sum(-1).mean() / scale
        if spec.architecture != "topk":
            loss = loss + 3e-3 * f.abs().sum(-1).mean() / scale.sqrt()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if spec.architecture == "jumprelu":  # a threshold that matters: half of each feature's mean positive pre-act
        with torch.no_grad():
            pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
            sae.threshold.copy_(0.5 * (pre.relu().sum(0) / (pre > 0).sum(0).clamp(min=1)))
    return sae.eval()


def write_openai(sae, path: Path) -> None:
    """An SAELens TopK SAE (layer_norm input, no rescale) in OpenAI's Autoencoder.state_dict() layout."""
    state = {
        "pre_bias": sae.b_dec.detach().clone(), "latent_bias": sae.b_enc.detach().clone(),
        "encoder.weight": sae.W_enc.detach().T.contiguous(), "decoder.weight": sae.W_dec.detach().T.contiguous(),
        "stats_last_nonzero": torch.zeros(sae.cfg.d_sae, dtype=torch.long),
        "latents_activation_frequency": torch.ones(sae.cfg.d_sae),
        "latents_mean_square": torch.zeros(sae.cfg.d_sae),
        "activation": "TopK", "activation_state_dict": {"k": sae.cfg.k, "postact_fn": "ReLU"},
    }
    torch.save(state, path)


def build(directory: Path, hf_model, tokenizer) -> dict[str, Any]:
    """Every SPECS SAE under directory/<name>/ (sae-lens's format) and directory/openai-topk.pt; returns the
    sae-lens objects by name (the OpenAI one under OPENAI.name)."""
    ids = docstring_ids(tokenizer, 48, 64)
    models: dict[str, Any] = {}
    made = {}
    for spec in (*SPECS, OPENAI):
        print(f"fitting the {spec.name} SAE at {spec.hook}", flush=True)
        key = json.dumps(spec.options, sort_keys=True)
        model = models.setdefault(key, tl_model(hf_model, **spec.options))
        with torch.no_grad():
            x = activations(model, spec, ids)
        sae = make_sae(spec, x, hf_model.config.n_head)
        if spec is OPENAI:
            write_openai(sae, directory / f"{spec.name}.pt")
        else:
            sae.save_model(directory / spec.name)
        made[spec.name] = sae
    return made


def openai_as_saelens(path: Path):
    """OpenAI's TopK file as the sae-lens TopK SAE with the same math (layer_norm input, no decoder-norm rescale)."""
    from sae_lens.saes.topk_sae import TopKSAE, TopKSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    state = torch.load(path, weights_only=True)
    n_latents, d = state["encoder.weight"].shape
    config = TopKSAEConfig(d_in=d, d_sae=n_latents, k=state["activation_state_dict"]["k"],
                           normalize_activations="layer_norm", rescale_acts_by_decoder_norm=False)
    config.metadata = SAEMetadata(hook_name=OPENAI.hook)
    sae = TopKSAE(config)
    sae.load_state_dict({"W_enc": state["encoder.weight"].T, "W_dec": state["decoder.weight"].T,
                         "b_enc": state["latent_bias"], "b_dec": state["pre_bias"]})
    return sae.eval()


def load(directory: Path) -> dict[str, Any]:
    """The SAEs build() wrote, read back by sae-lens (SAE.load_from_disk), by name."""
    from sae_lens import SAE

    saes = {spec.name: SAE.load_from_disk(directory / spec.name).eval() for spec in SPECS}
    saes[OPENAI.name] = openai_as_saelens(directory / f"{OPENAI.name}.pt")
    return saes


if __name__ == "__main__":
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(Path(__file__).parent))
    import fixtures
    from transformers import GPT2LMHeadModel

    from gpt2_engine import load_tokenizer

    out = Path(sys.argv[1])
    out.mkdir(parents=True)
    trained = fixtures.ensure("trained")
    hf = GPT2LMHeadModel.from_pretrained(trained, dtype=torch.float32).eval()
    torch.set_num_threads(2)
    for name in build(out, hf, load_tokenizer(trained)):
        print(f"made the {name} SAE")
