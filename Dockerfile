# lockstep for CUDA nodes (H100 / H200): PyTorch 2.11 (CUDA 13.0), the vLLM release its plugin's hooks were run on,
# megatron-core, Triton, and the production extras flash-attn and transformer-engine.
#   docker build -t lockstep .
#   docker run --gpus all --shm-size 32g -v $PWD/runs:/opt/lockstep/runs lockstep \
#     lockstep run qwen3-1.7b-1gpu trainer.steps=3
# The versions below are pinned in pyproject.toml too (tests/test_repo.py checks they agree).
FROM pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel

ARG VLLM_VERSION=0.26.0
ARG MEGATRON_CORE_VERSION=0.19.2
ARG TRITON_VERSION=3.6.0
ARG FLASH_ATTN_VERSION=2.8.3
ARG TRANSFORMER_ENGINE_VERSION=2.8.0

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_USE_V2_MODEL_RUNNER=0

RUN pip install "vllm==${VLLM_VERSION}" "megatron-core==${MEGATRON_CORE_VERSION}" "triton==${TRITON_VERSION}" \
 && pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}" \
      "transformer-engine[pytorch]==${TRANSFORMER_ENGINE_VERSION}"

WORKDIR /opt/lockstep
COPY . /opt/lockstep
RUN pip install -e ".[vllm,megatron,triton,production]"

CMD ["lockstep", "recipes"]
