"""A zoo of foreign architectures, as a user brings them: Hugging Face models built from tiny configs (nothing
downloaded) and one model of the user's own with its own init, each with the user's own dict data. One row per
family (`ROWS`): a new architecture is one builder and one row. Used by tests/test_zoo.py, which holds every row to
the same identities; the launches name `zoo.build` and `zoo.Samples` as `_target_`s (imported from this folder).

Data: deterministic per sample index (a user's map-style data set), from real material where it is on every
machine: Python's standard library sources as bytes for text, scikit-learn's digits for images.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

VOCAB, PAD, MASK = 260, 256, 257  # byte tokens 0..255, then padding and the mask token
LENGTH = 16


def _text(index: int, length: int = LENGTH) -> list[int]:
    """A window of Python's sources as bytes, its length varying with the index (padding in every batch)."""
    corpus = _corpus()
    size = length - (index * 7) % (length // 2)
    start = (index * 104_729) % (len(corpus) - size)
    return list(corpus[start:start + size])


_CORPUS: list[bytes] = []


def _corpus() -> bytes:
    if not _CORPUS:
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]
        _CORPUS.append(b"".join(p.read_bytes() for p in files))
    return _CORPUS[0]


def _hash(*keys: int) -> int:
    return zlib.crc32(repr(keys).encode())


def _digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0  # (N, 8, 8)
    images = images.repeat_interleave(2, 1).repeat_interleave(2, 2)  # 16 x 16
    return images[:, None].expand(-1, 3, -1, -1).contiguous(), torch.tensor(digits.target)


_DIGITS: list = []


# --- samples, one kind per family of inputs ---------------------------------------------------------------------

def sequence_class(index: int) -> dict:
    ids = _text(index)
    return {"input_ids": ids, "labels": int(sum(ids) % 3)}


def token_class(index: int) -> dict:
    ids = _text(index)  # per token: letter 0, digit or space 1, other 2
    return {"input_ids": ids, "labels": [0 if chr(t).isalpha() else 1 if chr(t).isspace() or chr(t).isdigit() else 2
                                         for t in ids]}


def masked(index: int) -> dict:
    ids = _text(index)
    chosen = [_hash(index, i) % 100 < 20 for i in range(len(ids))]
    chosen[0] = True  # every sample counts at least one label
    return {"input_ids": [MASK if c else t for t, c in zip(ids, chosen)],
            "labels": [t if c else -100 for t, c in zip(ids, chosen)]}


def causal(index: int) -> dict:
    ids = _text(index)
    return {"input_ids": ids, "labels": list(ids)}


def seq2seq(index: int) -> dict:
    ids = _text(index)
    return {"input_ids": ids, "labels": list(reversed(ids))[: len(ids) // 2]}


def image(index: int) -> dict:
    if not _DIGITS:
        _DIGITS.extend(_digits())
    images, labels = _DIGITS
    return {"pixel_values": images[index % len(images)], "labels": int(labels[index % len(labels)])}


def segmentation(index: int) -> dict:
    """A digit's image and a class per pixel (its brightness in three bands), its top rows labelled 255: the label
    SegFormer's own loss ignores (config.semantic_loss_ignore_index)."""
    pixels = image(index)["pixel_values"]
    labels = torch.bucketize(pixels[0], torch.tensor([0.3, 0.6]))
    labels[: 2 + index % 3] = 255
    return {"pixel_values": pixels, "labels": labels}


def speech(index: int) -> dict:
    """A waveform from 8 characters of text (40 samples per character: one frame of the feature encoder below),
    every clip the same length (padding a waveform changes its last frames), and 2 to 5 of its characters as CTC
    labels: samples with different numbers of labels."""
    ids = _text(index, 8)[:6] + [32, 32]
    wave = torch.tensor(ids, dtype=torch.float32).repeat_interleave(40) / 128.0 - 1.0
    wave = wave + 0.01 * torch.sin(torch.arange(len(wave)) * (1 + index % 5) * 0.1)
    return {"input_values": wave, "labels": [1 + t % 30 for t in ids[: 2 + index % 4]]}


def image_text(index: int) -> dict:
    return {**{k: v for k, v in image(index).items() if k != "labels"}, "input_ids": _text(index, 8)}


def features(index: int) -> dict:
    generator = torch.Generator().manual_seed(_hash(index))
    x = torch.randn(12, generator=generator)
    return {"x": x, "labels": int(x[:3].sum() > 0)}


SAMPLES = {f.__name__: f for f in (sequence_class, token_class, masked, causal, seq2seq, image, segmentation,
                                     speech, image_text, features)}


class Samples(torch.utils.data.Dataset):
    """`kind` of `SAMPLES`, `size` samples; an evaluation split starts further in."""

    def __init__(self, kind: str, size: int = 256, split: str = "train"):
        self.make, self.size, self.offset = SAMPLES[kind], size, 0 if split == "train" else 100_000

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        return self.make(index + self.offset)


def pad(samples: list[dict]) -> dict:
    """The user's collate: lists padded to the batch's longest (ids with PAD, labels with -100, waveforms with 0),
    an attention mask where there are ids, tensors stacked."""
    batch = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], torch.Tensor) and key != "input_values":
            batch[key] = torch.stack(values)
        elif isinstance(values[0], (list, torch.Tensor)):
            longest = max(len(v) for v in values)
            filler = {"input_ids": PAD, "labels": -100, "input_values": 0.0}[key]
            dtype = torch.float32 if key == "input_values" else torch.long
            out = torch.full((len(values), longest), filler, dtype=dtype)
            for row, v in enumerate(values):
                out[row, : len(v)] = torch.as_tensor(v, dtype=dtype)
            batch[key] = out
            if key == "input_ids":
                mask = torch.zeros_like(out)
                for row, v in enumerate(values):
                    mask[row, : len(v)] = 1
                batch["attention_mask"] = mask
        else:
            batch[key] = torch.tensor(values)
    if "pixel_values" in batch and "input_ids" in batch:
        batch["return_loss"] = True  # CLIP computes its contrastive loss
    return batch


# --- models --------------------------------------------------------------------------------------------------------

class OwnInit(nn.Module):
    """Not Hugging Face's: its own init (truncated normal, orthogonal, a constant), its own loss on dict batches."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.hidden = nn.Linear(12, width)
        self.out = nn.Linear(width, 2)
        self.scale = nn.Parameter(torch.empty(width))
        nn.init.trunc_normal_(self.hidden.weight, std=0.2)
        nn.init.orthogonal_(self.out.weight)
        nn.init.constant_(self.scale, 0.5)

    def forward(self, x, labels=None):
        logits = self.out(torch.relu(self.hidden(x)) * self.scale)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def _hf(config_name: str, model_name: str, **config):
    import transformers

    return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))


TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64, pad_token_id=PAD, bos_token_id=0, eos_token_id=0)
VISION = dict(image_size=16, num_channels=3, num_labels=10)

BUILDERS = {
    "bert_classifier": lambda: _hf("BertConfig", "BertForSequenceClassification", **TEXT, num_labels=3),
    "bert_token_classifier": lambda: _hf("BertConfig", "BertForTokenClassification", **TEXT, num_labels=3),
    # RoBERTa counts positions from its padding id (1, its convention: a byte that is never in the text)
    "roberta_masked_lm": lambda: _hf("RobertaConfig", "RobertaForMaskedLM", **{**TEXT, "pad_token_id": 1},
                                     tie_word_embeddings=True),
    "llama_causal_lm": lambda: _hf("LlamaConfig", "LlamaForCausalLM", **DECODER, num_key_value_heads=1,
                                   tie_word_embeddings=True),
    "gpt2_causal_lm": lambda: _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_positions=64, n_embd=32,
                                  n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0, pad_token_id=PAD),
    "mixtral_moe_lm": lambda: _hf("MixtralConfig", "MixtralForCausalLM", **DECODER, num_key_value_heads=1,
                                  num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                  router_aux_loss_coef=0.02),
    "t5_seq2seq": lambda: _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64,
                              num_layers=2, num_heads=2, dropout_rate=0.0, pad_token_id=PAD, decoder_start_token_id=PAD,
                              eos_token_id=0),
    "vit_classifier": lambda: _hf("ViTConfig", "ViTForImageClassification", **VISION, patch_size=4, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "swin_classifier": lambda: _hf("SwinConfig", "SwinForImageClassification", **VISION, patch_size=2, embed_dim=16,
                                   depths=[1, 1], num_heads=[2, 2], window_size=2, drop_path_rate=0.0),
    "convnext_classifier": lambda: _hf("ConvNextConfig", "ConvNextForImageClassification", **VISION, patch_size=2,
                                       num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], drop_path_rate=0.0),
    "resnet_batchnorm_classifier": lambda: _hf("ResNetConfig", "ResNetForImageClassification", num_channels=3,
                                               embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                               layer_type="basic", num_labels=10),
    "segformer_segmentation": lambda: _hf("SegformerConfig", "SegformerForSemanticSegmentation", num_labels=3,
                                          num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                                          num_attention_heads=[1, 1], decoder_hidden_size=16, patch_sizes=[7, 3],
                                          strides=[4, 2], mlp_ratios=[2, 2], hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                                          drop_path_rate=0.0),
    "wav2vec2_ctc": lambda: _hf("Wav2Vec2Config", "Wav2Vec2ForCTC", vocab_size=32, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 8),
                                conv_kernel=(10, 8), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                                hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                                final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, ctc_loss_reduction="mean", ctc_zero_infinity=True,
                                pad_token_id=0, do_stable_layer_norm=True, feat_extract_norm="layer"),
    "clip_contrastive": lambda: _clip(),
    "own_init": OwnInit,
}


def _clip():
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16, pad_token_id=PAD, bos_token_id=0, eos_token_id=1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4, num_channels=3)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return transformers.CLIPModel(config)


def build(name: str) -> nn.Module:
    """The model of row `name` (a `_target_`: model={_target_: zoo.build, name: vit_classifier})."""
    return BUILDERS[name]()


@dataclass
class Row:
    name: str
    samples: str  # a kind of SAMPLES
    shifts: bool  # whether per-token labels shift (a causal LM's do)
    # why a global batch split in two cannot give the same loss, where it cannot (None: it must, to 1e-5)
    not_split_invariant: str | None = None
    token_labels: bool = False  # per-token labels with -100: the accuracy must ignore them
    batch_norm: bool = False  # BatchNorm layers: 2 x B is not 1 x 2B in training (said at start, not to 1e-5)
    pixel_labels: bool = False  # a class per pixel, 255 ignored (the model's own index), class-first logits
    tags: list[str] = field(default_factory=list)


ROWS = [
    Row("bert_classifier", "sequence_class", False),
    Row("bert_token_classifier", "token_class", False, token_labels=True),
    Row("roberta_masked_lm", "masked", False, token_labels=True),
    Row("llama_causal_lm", "causal", True),
    Row("gpt2_causal_lm", "causal", True),
    Row("mixtral_moe_lm", "causal", True, not_split_invariant="its router's load-balancing loss is computed over the "
        "micro-batch's tokens as a whole (a product of two batch means), as the model defines it"),
    Row("t5_seq2seq", "seq2seq", False),
    Row("vit_classifier", "image", False),
    Row("swin_classifier", "image", False),
    Row("convnext_classifier", "image", False),
    # BatchNorm: in training, each micro-batch is normalized by its own statistics (said at start where the global
    # batch is split); the loss is still a mean over items, weighed as the model weighs it
    Row("resnet_batchnorm_classifier", "image", False, batch_norm=True),
    # its own loss ignores label 255, and its logits are class-first at a quarter of the labels' size; BatchNorm in
    # its decode head
    Row("segformer_segmentation", "segmentation", False, batch_norm=True, pixel_labels=True),
    Row("wav2vec2_ctc", "speech", False),
    Row("clip_contrastive", "image_text", False, not_split_invariant="a contrastive loss scores each pair against the "
        "rest of its micro-batch: another split is another loss, by definition"),
    Row("own_init", "features", False),
]
