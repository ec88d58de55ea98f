set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 C2W_COMMIT=4d349fd
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/device.txt
python3 -c "import torch; print(torch.__version__)" | tee -a $OUT/device.txt
STEP_S=200 VARIANTS='inplace|{}|--batch 1 --depth 16 --reps 20
chunkframes|{}|--batch 1 --depth 16 --reps 20|benchmarks/h200/results/run21_in_place/chunk_frames.patch' bash benchmarks/h200/variants.sh
