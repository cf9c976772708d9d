"""A trained tx_jax translation model in other frameworks' formats.

    weights.py       what can be exported (each refusal names the field) and the weights in
                     framework-neutral [out, in] matrices
    huggingface.py   a Transformers MarianMT directory: safetensors, config, tokenizer,
                     generation config
    ctranslate2.py   a CTranslate2 model directory, built from its own Transformer spec

Both formats need packages outside the core install: `pip install -e .[export]`.
"""
