#!/bin/bash
echo shared > /app/result.txt
echo "not an artifact" > /app/not-handed.txt
