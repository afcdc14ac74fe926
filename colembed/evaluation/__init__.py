"""`colembed eval`: retrieval quality (nDCG@k, recall@k, MRR@k) of colembed's search on a
labelled set the user has, comparing search modes, variants and image-token budgets.

    metrics.py   the metric functions over one ranking (pure Python)
    labelled.py  reading a labelled set: BEIR-style folders, ViDoRe / MTEB Parquet folders
    run.py       indexing the set's corpus into a folder the run owns, searching, the table

Standard library only at import; the index extra (and pyarrow for Parquet) when a run starts.
"""
