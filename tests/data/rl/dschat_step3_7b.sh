#!/bin/bash
# DeepSpeed-Chat step 3 on one node of 8 x A100-40G: a 7B actor and a 7B critic (written for dsdoctor's tests)
ACTOR_MODEL_PATH=$1
CRITIC_MODEL_PATH=$2
ACTOR_ZERO_STAGE=$3
CRITIC_ZERO_STAGE=$4
OUTPUT=$5
if [ "$ACTOR_ZERO_STAGE" == "" ]; then
    ACTOR_ZERO_STAGE=2
fi
if [ "$CRITIC_ZERO_STAGE" == "" ]; then
    CRITIC_ZERO_STAGE=2
fi
mkdir -p $OUTPUT

deepspeed --num_gpus 8 main.py \
   --data_path Dahoas/rm-static \
   --actor_model_name_or_path /data/ckpt/llama-2-7b-sft \
   --critic_model_name_or_path /data/ckpt/llama-2-7b-reward \
   --per_device_generation_batch_size 4 \
   --per_device_training_batch_size 4 \
   --generation_batches 1 --ppo_epochs 1 \
   --max_answer_seq_len 256 --max_prompt_seq_len 256 \
   --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 \
   --num_train_epochs 1 --lr_scheduler_type cosine \
   --gradient_accumulation_steps 1 \
   --offload_reference_model \
   --dtype fp16 \
   --deepspeed --seed 1234 \
   --actor_zero_stage $ACTOR_ZERO_STAGE \
   --critic_zero_stage $CRITIC_ZERO_STAGE \
   --output_dir $OUTPUT \
   &> $OUTPUT/training.log
