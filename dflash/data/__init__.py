"""Training data: where the offline files live (``assets``), chat templates and tokenizers
(``tokenizer``), conversation sources, normalisation and the tokenised corpus cache (``corpus``),
packing of conversations into fixed token budgets (``batching``) and the per-step batch plans
(``schedule``)."""
