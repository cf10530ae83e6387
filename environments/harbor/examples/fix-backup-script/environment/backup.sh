#!/bin/bash
dir=$1
mkdir -p $dir/backup
for f in $(ls $dir/*.txt); do
  cp $f $dir/backup/
done
