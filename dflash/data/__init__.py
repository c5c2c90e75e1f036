"""Training data: where the offline files live (``assets``); tokenizers (``tokenizer``, ``qwen``,
``chat_templates``); rows and their normalisation (``sources``, ``conversations``); rendering and
tokenising with the chat template (``render``); the data report (``report``); the tokenised corpus,
its cache and held-out split (``corpus``, ``corpus_cache``, ``heldout``) and its command line
(``cli``); packing of conversations into fixed token budgets (``batching``) and the per-step batch
plans (``schedule``)."""
