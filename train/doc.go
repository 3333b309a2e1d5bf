// Package train trains sparse-activation Llama models: a ReLU MLP gate with
// an L1 penalty on the hidden activations, so that most hidden units are
// exactly zero for each token.
//
// Run is the training loop (warmup + cosine schedule, data order, gradient
// accumulation, dead-unit tracking and re-initialisation, held-out
// evaluation, checkpoints, metrics.jsonl, plots, exact resume), written once
// over a Backend, which holds the model, its gradients and AdamW's state on
// one device. CPU is the float32 backend: the explicit forward and backward
// of every layer, generic over float32 and float64 so that float64 finite
// differences check each gradient.
//
// A run's folder holds checkpoint/ (a Hugging Face checkpoint plus
// optimizer.safetensors and trainer_state.json), metrics.jsonl and the
// plots loss.png, l0.png and dead.png. Checkpoints are rotated so that a
// kill at any moment leaves a complete one, and LoadCheckpoint finds the
// newest; the JSON files carry a schema name and version (MetricsSchema,
// StateSchema).
package train
