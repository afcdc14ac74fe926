"""Retrievers for RAG frameworks, over a `colembed.Index` or over `colembed serve`'s HTTP API
(docs/rag.md):

    pages.py       what both give a framework: `PageHit`s from an Index or from /v1/search
    langchain.py   `ColembedRetriever`, a langchain_core BaseRetriever (the `langchain` extra)
    llamaindex.py  `ColembedRetriever`, a llama_index.core BaseRetriever (the `llamaindex` extra)

Nothing here is imported by `import colembed`; each framework is imported by its own module only.
"""
