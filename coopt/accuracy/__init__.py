"""Accuracy harness that needs no downloads: a byte-level Llama trained on the Python standard
library's own source (`corpus`, `train`), the metrics that compare a candidate's logits with
a reference's on held-out text (`metrics`), and coopt builds of the trained model as candidates
(`builds`: through `coopt.Pipeline` and `coopt.load`, like any user). `bench/accuracy.py` runs
the whole thing.

    from coopt.accuracy import corpus, metrics, train
    data = corpus.load_corpus(max_bytes=2_000_000)
    model, history = train.train("tiny", steps=200, batch=16, seq_len=128, corpus=data)
    report = metrics.compare(metrics.model_logits_fn(model), candidate_fn, data.heldout)
"""
