// Package data turns text into token shards for training and reads them back.
//
// A dataset is a folder with an index.json and token shard files (.twsh, see OpenShard for the
// format). Build makes one from text files, folders of .txt/.md files and JSONL files: it
// normalizes the documents, drops exact duplicates, holds out the last documents of each
// source for validation, tokenizes in parallel and writes the shards. Open reads a dataset;
// its Loader yields reproducible, resumable batches of training windows and its Val iterator
// walks the held-out split of one source. HeldOut lists the held-out documents as text, by the
// same rule, to build evaluation tasks from text that a model did not train on.
//
// The package also embeds a small public-domain text sample (Sample, SampleFiles) so that the
// smallest training preset runs without downloading anything.
package data
