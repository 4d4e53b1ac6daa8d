"""Small, self-contained pieces for the hps training demo.

    >>> from ps.demo.corpus import load_corpus, BatchSampler
    >>> from ps.demo.model import ModelConfig, build_model
    >>> from ps.demo.report import summary_table, plot_loss

Everything here is pure and synchronous: no network, no server state.
"""
