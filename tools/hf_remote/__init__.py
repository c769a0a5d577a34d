"""Source files that ``earlyfuse-convert hf`` ships beside an export as Hugging Face remote code
(loaded with ``trust_remote_code=True``); each imports only torch and transformers."""
