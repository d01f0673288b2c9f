"""The fields every training config has, with their meaning and defaults.

Config files in ``configs/`` start from :func:`base_config`, add their
data fields (:func:`image_data` or :func:`text_data`) and set what their
experiment changes; ``python -m jpipe.train`` loads them locked, so a
flag that names a field not here is an error.
"""

import ml_collections

from jpipe import schedule as schedule_lib


def base_config() -> ml_collections.ConfigDict:
  """Model, optimizer, pipeline, schedule, staleness and loop fields."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds the params and the data order.
  for add_fields in (
    _model_fields,
    _optimizer_fields,
    _pipeline_fields,
    _schedule_fields,
    _staleness_fields,
    _data_parallel_fields,
    _dynamic_fields,
    _train_fields,
  ):
    add_fields(c)
  return c


def _model_fields(c: ml_collections.ConfigDict) -> None:
  """The model (its name and arguments) and where its params start."""
  # The user's whole task: "package.module:build", a function of this
  # config returning a jpipe.train.tasks.Task (model, loss, params, data,
  # evaluation); "" = the model below on the task of the config's data.
  c.task = ""
  # Model: jpipe.models.<name>.Model(**kwargs), which sets the task (mlp /
  # resnet / vgg classify images, gpt models text, t5 un-corrupts it), or
  # the user's Flax module "package.module:Module" on the config's data's
  # task (image fields: classification; text: language model; text with
  # span corruption: seq2seq).
  c.model = ml_collections.ConfigDict()
  c.model.name = "mlp"
  # A named size of a jpipe model (t5_v1: "small" ... "3b", "11b",
  # "v1_1-small" ... "v1_1-xxl"; gpt2: "small" ... "xl"; bert: "base",
  # "large"); model.kwargs override its fields.
  c.model.size = ""
  c.model.kwargs = ml_collections.ConfigDict()
  # The params' dtype ("bfloat16", "float16", "float32"): floating params
  # cast to it once initialised (or loaded by init_from), for any model;
  # their gradients and optimizer state follow (optimizer.grad_accum_dtype
  # ="float32" sums a step's microbatch gradients wider). The compute
  # dtype is the model's own (jpipe's models: model.kwargs.dtype).
  # "" = as the model initialises them.
  c.model.param_dtype = ""
  # Fine-tuning: start from pretrained params instead of a random init.
  # A jpipe workdir or checkpoint (its params), another orbax checkpoint
  # of params, a Flax msgpack file, "hf:PATH" (a HuggingFace checkpoint of
  # t5_v1, gpt2 or bert: safetensors, Flax msgpack or pytorch_model.bin,
  # read without torch), or "package.module:callable"
  # returning params
  # (e.g. a HuggingFace Flax model's .params); "" = random init.
  c.init_from = ""
  # Comma-separated regular expressions of param paths ("head/") that keep
  # the random init instead (a new head of another size).
  c.init_keep = ""


def _optimizer_fields(c: ml_collections.ConfigDict) -> None:
  """The optax optimizer, its learning-rate schedule and frozen params."""
  # Optimizer: optax.<name>: sgd (with momentum), adam, adamw (these three
  # work with Gap-Aware), or any optax optimizer taking a learning_rate:
  # adafactor, lamb, lion, rmsprop, lars, ... Weight prediction takes any
  # (it replays the optimizer with zero future gradients).
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.05  # Peak learning rate.
  c.optimizer.momentum = 0.9  # SGD only; 0 for plain SGD.
  # The optimizer's own argument where it has one (decoupled: adamw, lamb,
  # lion...), else L2 added to the gradient (sgd, adam, adafactor...).
  c.optimizer.weight_decay = 0.0
  # Comma-separated regular expressions of param paths weight_decay skips
  # (searched in "a/b/c" paths): "bias$,scale$" skips biases and Flax's
  # LayerNorm / RMSNorm scales, as BERT and GPT-2 train; "" decays every
  # leaf.
  c.optimizer.no_decay = ""
  # More keyword arguments of optax.<name>, as Python literals:
  # "b2=0.98,eps=1e-6"; adafactor: "multiply_by_parameter_scale=False".
  c.optimizer.args = ""
  # Clip the gradient to this global L2 norm over all stages before the
  # optimizer (optax.clip_by_global_norm on one device); 0: no clipping.
  # Streaming schedules (async, 2bw) have no step all stages share: each
  # stage's step uses its own gradient's norm with the other stages'
  # latest (one process only).
  c.optimizer.clip_norm = 0.0
  # The dtype a step's microbatch gradients are summed in and the optimizer
  # receives (DeepSpeed's grad_accum_dtype): "float32" for a model with
  # bfloat16 / float16 params, whose own mantissa drops small microbatch
  # gradients beside a large sum; "" = the params' own dtypes.
  c.optimizer.grad_accum_dtype = ""
  # A step whose gradient holds a NaN or an infinity changes nothing (what
  # optax.apply_if_finite does on one device); the run logs
  # train/skipped_steps instead of stopping. Synchronous schedules.
  c.optimizer.skip_nonfinite = False
  # Loss scaling for float16 activations (a model computing in float16,
  # whose small cotangents underflow): "" none; a number ("4096": static,
  # any schedule); "dynamic" (synchronous schedules): from 2**15, halved at
  # each step whose gradient overflows (the step skipped, as with
  # skip_nonfinite) and doubled after loss_scale_window finite steps;
  # logged as train/loss_scale and saved in checkpoints.
  c.optimizer.loss_scale = ""
  # A dynamic loss scale doubles after this many finite steps in a row
  # (DeepSpeed's loss_scale_window; jmp's period).
  c.optimizer.loss_scale_window = 2000
  # Learning-rate schedule: "constant"; "warmup_constant" (FTPipe's T5:
  # linear warm-up, then the peak); "warmup_cosine" (linear warm-up,
  # cosine decay to 0); "warmup_linear" (BERT: linear warm-up, linear
  # decay to 0 at the last step); "rsqrt" (T5: the peak for warmup_steps,
  # then peak * sqrt(warmup_steps / step)); "multistep" (WRN, ResNet: the
  # peak times decay_factor at each of decay_steps, after a linear warm-up
  # of warmup_steps where > 0).
  c.optimizer.schedule = "constant"
  c.optimizer.warmup_steps = 0  # Optimizer steps of warm-up.
  c.optimizer.decay_steps = ""  # multistep: optimizer steps, "3000,6000".
  c.optimizer.decay_factor = 0.2  # multistep: the factor at each.
  # Training steps warmup_cosine and warmup_linear decay over; 0: train.steps.
  # A resume with more train.steps stretches their decay (the rate at the
  # resumed step jumps); the earlier train.steps here keeps their schedule.
  c.optimizer.schedule_steps = 0
  # Comma-separated regular expressions of param paths that are not
  # trained (e.g. "^embed/,^block_0/"): held as model state, so no
  # gradient or optimizer state for them (jpipe.Pipeline's frozen=);
  # "" trains all.
  c.optimizer.freeze = ""


def _pipeline_fields(c: ml_collections.ConfigDict) -> None:
  """How the model is split into stages and placed."""
  # Pipeline: how the model is split and placed.
  c.pipeline = ml_collections.ConfigDict()
  # Stages, each on a device of its own (zbv, dualpipev: two a device;
  # stages_per_device below: that many); more than the devices is refused.
  c.pipeline.num_stages = 4
  c.pipeline.num_microbatches = 4  # Microbatches per step; divides batch.
  # Stages per device in a loop (Megatron's virtual stages, stage s on
  # device s mod p) for schedule interleaved, interleaved_zb or
  # looped_bfs: num_stages / stages_per_device devices.
  c.pipeline.stages_per_device = 1
  # "contiguous", "mixed", "pipedream" (PipeDream's DP, straight) or
  # "pipedream_hybrid" (its DP with replicated, data-parallel stages; the
  # replicas of a stage must divide the microbatch).
  c.pipeline.partition = "contiguous"
  # A plan given by hand instead of the partitioner's: nodes per stage in
  # program order, e.g. "4,4,4,4" (SD-Pipe's), adding up to the node count
  # of one depth (that depth is used); and/or devices per stage, e.g.
  # "15,1" (PipeDream's VGG-16: a replicated stage runs data parallel,
  # as replica_routing says; without split, the partitioner gives a
  # replicated stage more nodes). num_stages must be their stage count.
  c.pipeline.split = ""
  # Devices per stage, e.g. "15,1" (see split above); "": one each.
  c.pipeline.replicas = ""
  # "mixed" only: the block counts L its solver tries, e.g. "32" (FTPipe's
  # --L; at most L stages); "": P, 2P, 3P, 4P (6P-16P with a memory limit).
  c.pipeline.mixed_blocks = ""
  # The paper's own prediction for this plan (free text), which the plan
  # CLI prints beside its own; "" for none.
  c.pipeline.paper_plan = ""
  # How a replicated stage (pipedream_hybrid) shares its microbatches:
  # "split" (each split over the replicas; as one device) or
  # "round_robin" (PipeDream's 1F1B-RR: microbatch b whole on replica
  # b mod r; under async PipeDream's per-replica warm-up and its rate per
  # stage, lr x r_s / r_0) or "weighted" (DynPipe's DP-stage load
  # balancing: each microbatch split unevenly, any size; with
  # dynamic.enabled re-split by the replicas' measured speeds).
  c.pipeline.replica_routing = "split"
  # Recompute forwards in the backward (an async pipeline without weight
  # stashing needs it: saved residuals pin the forward's params).
  c.pipeline.recompute = False
  # The last stage's forward + backward as one program (same result).
  c.pipeline.fuse_last_stage = True
  # A stream's step in the program of the backward right before it (same
  # result on CPUs; one program fewer per step).
  c.pipeline.fuse_step = True
  # On GPUs, whether XLA records the stage programs as CUDA graphs: "auto"
  # (on for synchronous schedules, off for streams, whose params move
  # every microbatch and so re-point the graphs each call), "on", "off".
  c.pipeline.gpu_command_buffers = "auto"
  # Across processes (python -m jpipe.launch, SLURM): "pull" (never blocks
  # a device) or "collective" (ppermute: gloo / NCCL; ties the streams).
  c.pipeline.transport = "pull"
  # Module-path depth of the partitioner's nodes; 0 chooses it (the
  # shallowest depth whose split is as balanced as the deepest's).
  c.pipeline.depth = 0
  # Bytes/s between devices for the partitioner; 0 plans on compute alone
  # (transfers ignored; PipeDream's all-reduce then at 1e9 bytes/s).
  c.pipeline.bandwidth = 0.0
  # Node costs for the partitioner: "analytic" (FLOPs), "xla" (XLA's cost
  # analysis) or "measured" (each node timed on this machine; slower start).
  c.pipeline.cost_model = "analytic"
  # Memory each device may hold: "" (no check), "device" (the device's own
  # capacity, GPUs and TPUs) or a size ("16GiB", "512MiB", "2e9" bytes).
  # The partitioner keeps to it and a pipeline predicted not to fit stops
  # before training, naming the stage and the fixes.
  c.pipeline.memory_limit = ""


def _schedule_fields(c: ml_collections.ConfigDict) -> None:
  """The schedule and its step window."""
  # Schedule: a name from jpipe.schedule.SCHEDULES (synchronous: seq,
  # gpipe, 1f1b, eager1f1b, interleaved, looped_bfs, zero-bubble zbh1,
  # zbh2, interleaved_zb; zbv and dualpipev place 2 stages per device in
  # a V: num_stages = 2 x devices; streaming: async, 2bw), or "auto": the
  # synchronous one the plan runs fastest in simulation within
  # pipeline.memory_limit (its table printed and kept in plan.json).
  c.schedule = ml_collections.ConfigDict()
  c.schedule.name = "1f1b"
  # async: backwards per step; 2bw: microbatches per minibatch (>= stages).
  c.schedule.step_every = 1
  # async, 2bw: a flush's pending backwards run as I then W (zero-bubble's
  # split; same steps and delays, a shorter drain).
  c.schedule.split_flush = False
  # async: FTPipe's virtual_stages_1f1b cap on a mixed pipe's delays
  # (stage s: max(0, min(n, S - 1) - 1 - s)): "" none, "auto" (S = the
  # devices) or a number S.
  c.schedule.supremum_staleness = ""
  # A schedule written per device instead of schedule.name: a text file,
  # one line per device of actions {stage}{F|B|I|W|S}{microbatch} such as
  # "0F0 0F1 0I0 0W0 ..." (jpipe.schedule.parse_actions); run as written
  # after a check that names what would deadlock or be lost. "": none.
  c.schedule.file = ""


def _staleness_fields(c: ml_collections.ConfigDict) -> None:
  """Staleness mitigation of the asynchronous schedule."""
  # Staleness mitigation (schedule "async" only).
  c.staleness = ml_collections.ConfigDict()
  c.staleness.stashing = False  # Weight stashing.
  c.staleness.prediction = ""  # "", "msnag" or "aggmsnag".
  # "", "ga", "ga_jfl" or "ga_from_grad" (FTPipe's estimate, no stash:
  # with gap_aware_policy=almost_last_partition).
  c.staleness.gap_aware = ""
  c.staleness.gap_aware_policy = "all_except_last"  # FTPipe's stage policy.
  # FTPipe's: a delay-0 forward predicted one step ahead (needs prediction).
  c.staleness.nag_with_predictor = False
  # FTPipe's nesterov_set_for_last_partition: the last stage steps with
  # Nesterov momentum SGD and predicts nothing (optimizer.name "sgd").
  c.staleness.nesterov_last_stage = False
  # A step_every window a flush cuts short (r of se): "mean" (its mean) or
  # "ftpipe" (the sum over se, the learning rate times r / se).
  c.staleness.partial_window = "mean"
  # PipeMare's learning-rate rescheduling: a stage d steps late scales its
  # rate by d ** -(1 - min(k / K, 1)); K in optimizer steps, 0 = off, -1 = a
  # quarter of the run.
  c.staleness.pipemare_anneal_steps = 0
  # The delay-aware Nesterov method (Ajanthan et al., ICML 2025): each
  # stage steps with NAdam(W) (adam, adamw) or Nesterov SGD (sgd): ""
  # (off), "adaptive" (momentum raised with the stage's delay, from the
  # optimizer's toward 0.99) or "fixed" (beta1 0.99 on every stage: the
  # authors' runs; adam / adamw). Run it with stashing, as they do.
  c.staleness.delay_nesterov = ""


def _data_parallel_fields(c: ml_collections.ConfigDict) -> None:
  """Several pipelines in data parallel (SD-Pipe)."""
  # Several pipelines in data parallel (SD-Pipe): P copies of the
  # partitioned pipeline on disjoint devices (each gets devices // P),
  # each on its own shard of the data at its own pace.
  c.data_parallel = ml_collections.ConfigDict()
  c.data_parallel.pipelines = 1  # P; 1 = one pipeline (the usual loop).
  # How replicas of a stage synchronise: "allreduce" (gradient mean every
  # step), "preduce" (SD-Pipe's partial reduce), "adpsgd" (random pairs)
  # or "hetpipe" (parameter server, push/pull every hetpipe_every).
  c.data_parallel.sync = "allreduce"
  # Batches per pipeline in an epoch, on average (fast pipelines run more);
  # evaluation and a checkpoint after each. 0: train.eval_every.
  c.data_parallel.epoch_batches = 0
  c.data_parallel.ssp_bound = 10  # preduce: rounds between graph syncs.
  c.data_parallel.hetpipe_every = 10  # hetpipe: batches between pushes.
  c.data_parallel.gossip_seed = 0  # adpsgd: the shared shuffle seed.
  # Which devices a pipeline gets: "pipeline" (consecutive ones: under
  # jpipe.launch, a process per pipeline or several) or "stage" (the s-th
  # block of `pipelines` devices holds every pipeline's stage s: with
  # --devices-per-process = pipelines, SD-Pipe's process per stage).
  c.data_parallel.placement = "pipeline"
  # Simulated heterogeneity (seeded by config.seed), SD-Pipe's hetero: the
  # seconds a forward or backward is delayed with probability 0.1.
  c.data_parallel.hetero = 0.0
  # A simulated compute time per forward / backward (ms); 0: none.
  c.data_parallel.simulated_ms = 0.0
  # Per-device slowdown factors of simulated_ms, "DEVICE:FACTOR,..." (e.g.
  # "0:3.0"); "": none.
  c.data_parallel.slowdown = ""


def _dynamic_fields(c: ml_collections.ConfigDict) -> None:
  """Re-partitioning while training (DynPipe)."""
  # Re-partitioning while training when a device slows down (DynPipe).
  # One profiled step per window measures each stage's time; a stage slot
  # whose slowdown moved by the trigger's factor (>= high or <= low) makes
  # the policy re-solve the split: "jpipe" (exact split for the measured
  # slowdowns, switched to when the simulated gain over horizon_steps
  # beats the switch's measured cost), "dynpipe" (DynPipe's top_k
  # candidate cuts scored by its 1F1B simulation) or "static" (measure
  # only). State moves by parameter path; nothing is reset.
  c.dynamic = ml_collections.ConfigDict()
  c.dynamic.enabled = False  # Measure and re-partition (DynPipe).
  c.dynamic.policy = "jpipe"  # "jpipe", "dynpipe" or "static" (above).
  c.dynamic.window = 20  # Steps per measurement window.
  c.dynamic.warmup_windows = 1  # Windows before the reference window.
  c.dynamic.high = 2.0  # Trigger: a slot's slowdown moved by >= this factor.
  c.dynamic.low = 0.5  # Trigger: ... or <= this one (a device sped up).
  c.dynamic.top_k = 2  # DynPipe's candidate cuts per stage.
  c.dynamic.horizon_steps = 0  # Steps a switch must pay off in; 0: 2 windows.
  # DynPipe's slowdown predictor: a file written by `python -m
  # jpipe.train.slowdowns --config ... --out PATH` (a random forest fitted
  # on stage times this config's pipeline measured under injected
  # slowdowns): a candidate stage's slowdown on a slowed device is
  # predicted from its features. "": the device's measured slowdown
  # applies to whatever layers it holds.
  c.dynamic.predictor = ""
  # Injected slowdowns (sleeps, for experiments): "DEVICE:FACTOR:FROM_STEP
  # [:TO_STEP]", comma-separated.
  c.dynamic.inject = ""
  # Every forward + backward of the whole model per microbatch sleeps this
  # long (ms), split by the stages' cost shares (0: only the injected
  # extra sleeps).
  c.dynamic.simulated_ms = 0.0


def _train_fields(c: ml_collections.ConfigDict) -> None:
  """The training loop: steps, logs, evaluations, checkpoints, checks."""
  # Training loop.
  c.train = ml_collections.ConfigDict()
  # Pipeline steps (each covers batch_size examples); 0: evaluation only
  # (the workdir's checkpoint, else init_from's or the initial params).
  c.train.steps = 300
  c.train.log_every = 25  # Steps between metric logs.
  c.train.eval_every = 100  # Steps between evaluations (and at the end).
  c.train.checkpoint_every = 100  # Steps between checkpoints (and at end).
  c.train.keep_checkpoints = 2  # Checkpoints kept in the workdir.
  # Cross-entropy targets (1 - e) on the label + e / classes on each class
  # (the built-in tasks' training loss; evaluation is unsmoothed).
  c.train.label_smoothing = 0.0
  c.train.profile_last_step = True  # Timeline PNG + trace of the last step.
  # Stop when a logged window's mean loss exceeds this many times the
  # loss of the run's first step (a diverged run); 0 turns the check off.
  c.train.divergence_factor = 10.0
  # Seconds without a completed step, evaluation or checkpoint after
  # which the run counts as hung: every process writes its stacks and
  # the run exits with status 124. 0: max(300, 20x the median step, 3x
  # the longest evaluation or checkpoint so far).
  c.train.hang_timeout = 0.0


def image_data(name: str = "digits") -> ml_collections.ConfigDict:
  """Fields of an image classification dataset."""
  d = ml_collections.ConfigDict()
  d.format = "images"  # What the examples are (see jpipe.train.tasks).
  d.name = name  # "digits" (embedded) or a TFDS image dataset name.
  d.data_dir = ""  # TFDS data dir; "" = the default for the dataset.
  d.image_key = "image"  # The image's feature name in a TFDS dataset.
  d.label_key = "label"  # The label's feature name.
  # [H, W, C] the model sees; () = the dataset's. Set and different from
  # a TFDS dataset's (ImageNet's vary): images are read per batch and
  # resized (training: random crop + flip; evaluation: centre crop).
  d.image_shape = ()
  d.eval_examples = 0  # Streamed images: the eval split's first N; 0: all.
  d.batch_size = 64  # Examples per step (split into microbatches).
  d.train_split = "train"  # Training split (TFDS slicing: "train[:50%]").
  d.eval_split = "test"  # Split for the periodic evaluation.
  return d


def text_data(
  name: str = "stdlib_text",
  span_corruption: bool = False,
  masked_lm: bool = False,
) -> ml_collections.ConfigDict:
  """Fields of a text dataset (bytes are the tokens unless a tokenizer
  file is named)."""
  d = ml_collections.ConfigDict()
  d.format = "text"  # What the examples are (see jpipe.train.tasks).
  # "stdlib_text" (embedded), a TFDS text dataset's name, or "text_files"
  # (train_split and eval_split are then paths or glob patterns of text
  # files, e.g. WikiText-2's wiki.train.raw and wiki.valid.raw).
  d.name = name
  d.data_dir = ""  # TFDS data dir; "" = the default for the dataset.
  d.text_key = "text"  # Feature holding the text in a TFDS dataset.
  # "" = bytes; a SentencePiece model (*.model) or HuggingFace
  # tokenizer.json by path (the model's vocab_size must hold its ids).
  d.tokenizer = ""
  d.batch_size = 32  # Sequences per step (split into microbatches).
  d.sequence_length = 128  # Tokens per sequence (the model's input).
  d.train_split = "train"  # Training split (TFDS slicing: "train[:50%]").
  d.eval_split = "test"  # Split for the periodic evaluation.
  # Held-out sequences: consecutive windows of the eval split's text, each
  # token scored once; at most this many (spread evenly over a longer
  # text), 0 = every window (a masked LM draws this many pairs).
  d.eval_sequences = 128
  if span_corruption:
    d.noise_density = 0.15  # T5: fraction of bytes masked out.
    d.mean_span_length = 3.0  # T5: mean length of a masked span.
  if masked_lm:  # BERT's pre-training: [CLS] A [SEP] B [SEP], NSP.
    d.mask_rate = 0.15  # Tokens predicted (80% [MASK], 10% random).
  return d


def text_classification_data(
  name: str = "glue/sst2", text_keys: str = "sentence"
) -> ml_collections.ConfigDict:
  """Fields of a TFDS sentence or sentence-pair classification dataset
  (GLUE-style: ``glue/rte`` has text_keys "sentence1,sentence2")."""
  d = _text_task_data("classification", name)
  d.text_keys = text_keys  # Comma-separated Text features, in order.
  d.label_key = "label"  # A ClassLabel feature (its names: T5's targets).
  d.sequence_length = 128  # Tokens of the input (the segments packed).
  d.target_length = 8  # Encoder-decoders: tokens of the label's name.
  return d


def qa_data(name: str = "squad") -> ml_collections.ConfigDict:
  """Fields of a TFDS extractive QA dataset (SQuAD-style: an answers
  feature of ``text`` and ``answer_start`` characters in the context)."""
  d = _text_task_data("qa", name)
  d.question_key = "question"  # The question's feature name.
  d.context_key = "context"  # The passage's feature name.
  d.answers_key = "answers"  # The answers' (text, answer_start) feature.
  d.sequence_length = 384  # Tokens of question + context.
  d.target_length = 32  # Encoder-decoders: tokens of the answer.
  return d


def translation_data(
  name: str = "wmt16_translate/de-en", source_key: str = "en", target_key="de"
) -> ml_collections.ConfigDict:
  """Fields of a TFDS translation dataset (a Translation feature: one
  Text per language)."""
  d = _text_task_data("translation", name)
  d.source_key = source_key  # The source language's key in the feature.
  d.target_key = target_key  # The target language's.
  d.sequence_length = 128  # Source tokens (decoder-only: source + target).
  d.target_length = 128  # Encoder-decoders: target tokens.
  return d


def _text_task_data(fmt: str, name: str) -> ml_collections.ConfigDict:
  """Fields every TFDS text task's data has."""
  d = ml_collections.ConfigDict()
  d.format = fmt  # What the examples are (see jpipe.train.tasks).
  d.name = name  # A TFDS dataset, prepared in data_dir.
  d.data_dir = ""  # TFDS data dir; "" = the default for the dataset.
  # "" = bytes; a SentencePiece model (*.model) or HuggingFace
  # tokenizer.json by path (the model's vocab_size must hold its ids).
  d.tokenizer = ""
  d.batch_size = 32  # Examples per step (split into microbatches).
  d.train_split = "train"  # Training split (TFDS slicing: "train[:50%]").
  d.eval_split = "validation"  # Split for the periodic evaluation.
  d.eval_examples = 0  # The eval split's first examples; 0: all of it.
  return d


MITIGATIONS = {"ws": "stashing", "wp": "prediction", "ga": "gap_aware"}
# FTPipe's further options a variant may add: no recomputation, NAG with
# the predictor, a Nesterov last stage.
FTPIPE_OPTIONS = ("nr", "nag", "nesterov")
# The newer delay corrections a variant may add: PipeMare's rescheduling
# over a quarter of the run, the delay-aware Nesterov method (adaptive).
DELAY_CORRECTIONS = ("pm", "dnag")
# The replica routing a variant may add: PipeDream's round robin
# (1F1B-RR), DynPipe's weighted split.
ROUTINGS = ("rr", "wr")
# Variants naming a schedule outright (the rest set staleness options).
SYNCHRONOUS_VARIANTS = schedule_lib.SYNCHRONOUS


def apply_variant(c: ml_collections.ConfigDict, variant: str) -> None:
  """Sets the schedule and staleness fields a variant name stands for.

  Args:
    c: a config from :func:`base_config` (changed in place).
    variant: "stale" (asynchronous 1F1B, no mitigation); "ws", "wp", "ga"
      or a "+"-joined combination such as "ws+wp" (asynchronous with
      weight stashing, msnag weight prediction, Gap-Aware; the backward
      recomputes, ``pipeline.recompute = True``, unless "ws"), to which
      FTPipe's options add: "nr" (no recomputation: without "ws", weight
      gradients from the forward's activations, input gradients at the
      current weights), "nag" (``staleness.nag_with_predictor``, with
      "wp"), "nesterov" (``staleness.nesterov_last_stage``) -- e.g.
      "stale+nr", FTPipe's WRN "wp+nag+nesterov" -- and the newer
      corrections "pm" (PipeMare, ``staleness.pipemare_anneal_steps`` a
      quarter of the run) and "dnag" (``staleness.delay_nesterov``
      "adaptive"), e.g. "ws+dnag", and "rr" (PipeDream's round-robin
      replicas, ``pipeline.replica_routing``, for a replicated plan:
      "ws+rr" is PipeDream's 1F1B-RR) and "wr" (DynPipe's weighted
      split, ``pipeline.replica_routing = "weighted"``); "2bw"
      (PipeDream-2BW); or a synchronous schedule (``jpipe.schedule.
      SYNCHRONOUS``: "seq", "gpipe", "1f1b", "zbh1", ...).
  """
  parts = variant.split("+")
  kind = schedule_lib.REGISTRY.get(variant)
  if variant in SYNCHRONOUS_VARIANTS or (kind and kind.two_versions):
    c.schedule.name = variant
    if kind.two_versions:  # A step per minibatch.
      c.schedule.step_every = c.pipeline.num_microbatches
    return
  known = (
    set(MITIGATIONS)
    | set(FTPIPE_OPTIONS)
    | set(DELAY_CORRECTIONS)
    | set(ROUTINGS)
    | {"stale"}
  )
  if not set(parts) <= known or len(set(parts)) != len(parts):
    raise ValueError(
      f"unknown config variant {variant!r}: use 'stale', a '+'-joined "
      f"combination of {sorted(MITIGATIONS)} (and FTPipe's "
      f"{list(FTPIPE_OPTIONS)}, the corrections {list(DELAY_CORRECTIONS)}, "
      f"the routing {list(ROUTINGS)}), "
      f"'2bw' or one of {SYNCHRONOUS_VARIANTS} "
      "(e.g. --config configs/wrn_stale.py:ws+wp)"
    )
  (c.schedule.name,) = schedule_lib.STALE  # The one stale schedule.
  c.staleness.stashing = "ws" in parts
  c.staleness.prediction = "msnag" if "wp" in parts else ""
  c.staleness.gap_aware = "ga" if "ga" in parts else ""
  c.staleness.nag_with_predictor = "nag" in parts
  c.staleness.nesterov_last_stage = "nesterov" in parts
  c.staleness.pipemare_anneal_steps = -1 if "pm" in parts else 0
  c.staleness.delay_nesterov = "adaptive" if "dnag" in parts else ""
  if "rr" in parts and "wr" in parts:
    raise ValueError(
      f"config variant {variant!r}: 'rr' and 'wr' are two replica "
      "routings; pick one"
    )
  if "rr" in parts:
    c.pipeline.replica_routing = "round_robin"
  if "wr" in parts:
    c.pipeline.replica_routing = "weighted"
  # Recompute unless stashing (ws without nr: saved residuals, at the
  # forward's params) or FTPipe's nr asked for.
  c.pipeline.recompute = not (c.staleness.stashing or "nr" in parts)
