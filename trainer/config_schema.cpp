// config_schema.cpp: the one table of valid config keys, their types, defaults and help.
// A key that is not here is an error in a config file or an override. Defaults describe a
// small CPU-friendly run; configs/*.cfg set what differs.
#include "trainer/config.h"

namespace loom {

namespace {
constexpr ConfigType I = ConfigType::Int, F = ConfigType::Float, B = ConfigType::Bool,
                     S = ConfigType::String;
}  // namespace

const std::vector<ConfigKey>& config_schema() {
  static const std::vector<ConfigKey> schema = {
      // ---------------------------------------------------------------- model
      {"model", "kind", S, "vlm", "model family: vlm (ViT + projector + LM) or mim (latent masked image modeling)", "vlm|mim"},
      {"model", "image_size", I, "32", "input image side in pixels (square)", nullptr},
      {"model", "patch_size", I, "4", "ViT patch side in pixels; image_size must be a multiple", nullptr},
      {"model", "channels", I, "3", "image channels (3 RGB, 1 grey)", nullptr},
      {"model", "vit_dim", I, "64", "ViT width D", nullptr},
      {"model", "vit_depth", I, "2", "ViT blocks", nullptr},
      {"model", "vit_heads", I, "4", "ViT attention heads (vit_dim must be a multiple)", nullptr},
      {"model", "vit_mlp_ratio", I, "4", "ViT MLP hidden = ratio * vit_dim", nullptr},
      {"model", "pos_init", S, "normal", "initial ViT position embeddings (then learned): normal (std 0.02) or sincos (MAE's 2-D sine-cosine table, also for the MIM predictor; vit_dim and pred_dim % 4 == 0)", "normal|sincos"},
      {"model", "lm_vocab", I, "0", "LM vocabulary size; 0 = from the tokenizer", nullptr},
      {"model", "lm_dim", I, "96", "LM width D", nullptr},
      {"model", "lm_depth", I, "2", "LM decoder layers", nullptr},
      {"model", "lm_heads", I, "4", "LM query heads", nullptr},
      {"model", "lm_kv_heads", I, "2", "LM key/value heads (grouped-query attention; divides lm_heads)", nullptr},
      {"model", "lm_hidden", I, "256", "LM SwiGLU hidden width", nullptr},
      {"model", "rope_theta", F, "100000", "RoPE base", nullptr},
      {"model", "shuffle", I, "2", "pixel-shuffle factor between ViT and projector (1 = none)", nullptr},
      {"model", "pred_dim", I, "48", "MIM predictor width", nullptr},
      {"model", "pred_depth", I, "1", "MIM predictor blocks", nullptr},
      {"model", "pred_heads", I, "3", "MIM predictor heads", nullptr},
      {"model", "mask_ratio", F, "0.75", "MIM fraction of patches masked", nullptr},
      {"model", "tau", F, "0.1", "MIM patch-discrimination and InfoNCE temperature", nullptr},
      {"model", "ema", F, "0.996", "MIM target-encoder EMA decay per optimizer step", nullptr},
      {"model", "contrastive", B, "false", "MIM: two views per image plus symmetric InfoNCE", nullptr},
      {"model", "contrastive_weight", F, "0.1", "MIM: weight of the InfoNCE term", nullptr},
      {"model", "lm_init", S, "", "LM weights to start from: HF folder, checkpoint or run folder (newest checkpoint), or .safetensors file; \"\" = random", nullptr},
      {"model", "vision_init", S, "", "ViT weights to start from: HF SigLIP folder, checkpoint or run folder (VLM vision.* or MIM encoder.*), or .safetensors file; \"\" = random", nullptr},
      {"model", "init", S, "", "whole VLM (vision, projector, LM) to continue from: a run folder (newest checkpoint), a checkpoint folder or its model.safetensors; the run's tokenizer comes with it (stage 2 of the two-stage recipe); \"\" = none", nullptr},
      // ---------------------------------------------------------------- data
      {"data", "dataset", S, "shapes", "training data", "shapes|fashion_mnist|jsonl|image_folder|synthetic"},
      {"data", "task", S, "qa", "shapes data: qa = one question per image (colour, shape, count, position), caption = \"Describe the image.\" answered by the scene's caption (stage 1 of the two-stage recipe)", "qa|caption"},
      {"data", "path", S, "", "dataset location: JSONL file, image folder or IDX folder (\"\" = built-in default)", nullptr},
      {"data", "val_path", S, "", "held-out JSONL / image folder; \"\" = split val_samples off the training data", nullptr},
      {"data", "tokenizer", S, "", "HF tokenizer.json to use (missing ChatML tokens are added); \"\" = train a byte-level BPE on the training text", nullptr},
      {"data", "vocab_size", I, "512", "vocabulary size when training the tokenizer", nullptr},
      {"data", "train_samples", I, "20000", "training samples (generated datasets) or a cap (0 = all)", nullptr},
      {"data", "val_samples", I, "500", "validation samples", nullptr},
      {"data", "seed", I, "1", "seed of generated data and of the epoch shuffle", nullptr},
      {"data", "use_sequence_packing", B, "true", "pack several samples per row (best-fit decreasing)", nullptr},
      {"data", "pack_max_length", I, "256", "row length in tokens, image tokens included", nullptr},
      {"data", "workers", I, "1", "data-loading threads", nullptr},
      {"data", "strict", B, "false", "a bad sample is an error instead of a counted, skipped warning", nullptr},
      {"data", "synth_median_len", I, "200", "synthetic VLM text: lognormal median length in tokens (SPEC bench)", nullptr},
      {"data", "synth_sigma", F, "0.7", "synthetic VLM text: lognormal sigma", nullptr},
      {"data", "synth_min_len", I, "24", "synthetic VLM text: shortest text length", nullptr},
      {"data", "synth_max_len", I, "1500", "synthetic VLM text: longest text length", nullptr},
      {"data", "max_image_pixels", I, "67108864", "images with more pixels are skipped (decode guard)", nullptr},
      // ---------------------------------------------------------------- train
      {"train", "trainer", S, "vlm_sft", "training recipe", "vlm_sft|vlm_pretrain|vit_mim"},
      {"train", "device", S, "auto", "auto = cuda when a GPU is present", "auto|cpu|cuda"},
      {"train", "dtype", S, "auto", "compute dtype; auto = bf16 on cuda, f32 on cpu; fp16 scales the loss", "auto|f32|bf16|fp16"},
      {"train", "loss_scale", F, "65536", "fp16: the initial dynamic loss scale (halved on an overflow)", nullptr},
      {"train", "loss_scale_window", I, "2000", "fp16: applied steps in a row before the loss scale doubles", nullptr},
      {"train", "attention", S, "loom", "CUDA attention: loom's kernels, cuDNN's fused attention (bf16), or auto = per shape bucket the faster (timed once; each new bucket of a packed run costs a plan build)", "auto|loom|cudnn"},
      {"train", "steps", I, "1000", "optimizer steps", nullptr},
      {"train", "batch_size", I, "16", "images (mim) or packed rows (vlm) per step, per device", nullptr},
      {"train", "grad_accum", I, "1", "micro-batches per optimizer step", nullptr},
      {"train", "lr", F, "1e-3", "peak learning rate", nullptr},
      {"train", "min_lr", F, "1e-4", "final learning rate of the cosine/linear schedule", nullptr},
      {"train", "warmup_steps", I, "50", "linear warmup steps", nullptr},
      {"train", "schedule", S, "cosine", "learning-rate schedule after warmup", "cosine|linear|constant"},
      {"train", "weight_decay", F, "0.01", "decoupled weight decay (matrices only)", nullptr},
      {"train", "beta1", F, "0.9", "AdamW beta1", nullptr},
      {"train", "beta2", F, "0.95", "AdamW beta2", nullptr},
      {"train", "eps", F, "1e-8", "AdamW epsilon", nullptr},
      {"train", "grad_clip", F, "1.0", "clip the global gradient norm to this (0 = off)", nullptr},
      {"train", "optimizer", S, "adamw", "optimizer", "adamw|sgd"},
      {"train", "momentum", F, "0.9", "SGD momentum", nullptr},
      {"train", "freeze", S, "", "comma list of parameter-name prefixes not trained (\"\" = none)", nullptr},
      {"train", "seed", I, "0", "seed of initialization, masks and dropout", nullptr},
      {"train", "log_every", I, "10", "steps between log lines", nullptr},
      {"train", "eval_every", I, "200", "steps between evaluations (0 = only at the end)", nullptr},
      {"train", "save_every", I, "0", "steps between checkpoints (0 = only at the end)", nullptr},
      {"train", "keep_last", I, "2", "checkpoints kept in out_dir (older ones are deleted)", nullptr},
      {"train", "out_dir", S, "runs/run", "run folder: config, metrics.jsonl, checkpoints, plots", nullptr},
      {"train", "resume", S, "", "\"\" = fresh start, latest = newest checkpoint in out_dir, or a checkpoint path", nullptr},
      {"train", "dry_run", B, "false", "build everything, run one step, print shapes and exit", nullptr},
      {"train", "profile", B, "false", "time each phase of the step and print a table", nullptr},
      {"train", "grad_checkpointing", B, "false", "recompute each transformer block's activations in the backward instead of keeping them (less memory, ~1/3 more compute)", nullptr},
      {"train", "cuda_graph", B, "true", "CUDA: capture the whole step (forward, backward, clip, AdamW, EMA) into a CUDA graph after 3 eager steps and replay it (MIM; static shapes)", nullptr},
      {"train", "lr_scale_embeddings", F, "1.0", "learning-rate factor of the embeddings group (token/position embeddings, mask token)", nullptr},
      {"train", "lr_scale_projector", F, "1.0", "learning-rate factor of the projector group (VLM)", nullptr},
      {"train", "lr_scale_norms", F, "1.0", "learning-rate factor of the norms group (norm gains and biases, 1-D)", nullptr},
      {"train", "embeddings_weight_decay", F, "-1", "weight decay of the embeddings group (-1: train.weight_decay; norms get none)", nullptr},
      {"train", "max_nan_skips", I, "5", "consecutive non-finite losses skipped before aborting", nullptr},
      {"train", "gpus", I, "0", "GPUs on this machine: N > 1 starts N ranks (one process per GPU, NCCL data parallel); batch_size is per GPU. Ignored under torchrun/srun (their environment sets the ranks)", nullptr},
      {"train", "dist_join_timeout", F, "60", "data parallel: seconds for every rank to reach rank 0 (MASTER_ADDR:MASTER_PORT+1)", nullptr},
      {"train", "dist_timeout", F, "600", "data parallel: a rank that finishes no step in this many seconds (a hung collective) stops every rank", nullptr},
      {"train", "stop_at", I, "0", "stop after this step as if interrupted, checkpoint kept (0 = run to train.steps)", nullptr},
      // ---------------------------------------------------------------- eval
      {"eval", "samples", I, "200", "evaluation samples", nullptr},
      {"eval", "max_new_tokens", I, "8", "greedy decoding length for VQA answers", nullptr},
      {"eval", "probe", S, "knn", "MIM representation probe", "linear|knn"},
      {"eval", "knn_k", I, "20", "neighbours of the kNN probe", nullptr},
  };
  return schema;
}

}  // namespace loom
