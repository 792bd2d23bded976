# an HF example script run for prediction with the training config
CUDA_VISIBLE_DEVICES=0,1 deepspeed --num_gpus 2 run_translation.py \
    --model_name_or_path google-t5/t5-small --deepspeed ds_z3_auto.json \
    --do_predict --predict_with_generate --per_device_eval_batch_size 8 \
    --output_dir out --bf16
