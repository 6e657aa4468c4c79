{{/*
kvmapper.rules is the PrometheusRule's spec, a Prometheus rule file: the alerts of
files/kvmapper-rules.yaml, each expression rendered with the job and the thresholds, less those
metrics.prometheusRule.disabled names, with its customRules' for and severity, the
additionalRuleLabels and additionalRuleAnnotations, and runbook_url: runbookUrl#<alert in lower
case>. A name in disabled or customRules that is no alert of the file fails the render, as does
a severity in additionalRuleLabels or a runbook_url in additionalRuleAnnotations (customRules
and runbookUrl set those).
*/}}
{{- define "kvmapper.rules" -}}
{{- $pr := .Values.metrics.prometheusRule -}}
{{- $ctx := dict "job" .Values.metrics.job "thresholds" $pr.thresholds "parkedStream" (get .Values.config "parked-stream" | default "PARKED") -}}
{{- $file := .Files.Get "files/kvmapper-rules.yaml" | fromYaml -}}
{{- if hasKey $file "Error" -}}
{{- fail (printf "files/kvmapper-rules.yaml: %s" $file.Error) -}}
{{- end -}}
{{- range $k, $_ := $pr.additionalRuleLabels -}}
{{- if eq $k "severity" -}}
{{- fail "metrics.prometheusRule.additionalRuleLabels: severity is each alert's own; set one alert's with customRules.<alert>.severity" -}}
{{- end -}}
{{- end -}}
{{- if hasKey $pr.additionalRuleAnnotations "runbook_url" -}}
{{- fail "metrics.prometheusRule.additionalRuleAnnotations: runbook_url comes from metrics.prometheusRule.runbookUrl" -}}
{{- end -}}
{{- $alerts := list -}}
{{- $groups := list -}}
{{- range $g := $file.groups -}}
{{- $rules := list -}}
{{- range $r := $g.rules -}}
{{- $alerts = append $alerts $r.alert -}}
{{- if not (get $pr.disabled $r.alert) -}}
{{- $custom := get $pr.customRules $r.alert | default dict -}}
{{- $labels := dict -}}
{{- range $k, $v := get $r "labels" | default dict }}{{ $_ := set $labels $k $v }}{{ end -}}
{{- range $k, $v := $pr.additionalRuleLabels }}{{ $_ := set $labels $k (toString $v) }}{{ end -}}
{{- with get $custom "severity" }}{{ $_ := set $labels "severity" . }}{{ end -}}
{{- $annotations := dict -}}
{{- range $k, $v := get $r "annotations" | default dict }}{{ $_ := set $annotations $k $v }}{{ end -}}
{{- range $k, $v := $pr.additionalRuleAnnotations }}{{ $_ := set $annotations $k (toString $v) }}{{ end -}}
{{- $_ := set $annotations "runbook_url" (printf "%s#%s" (trimSuffix "/" $pr.runbookUrl) (lower $r.alert)) -}}
{{- $rule := dict "alert" $r.alert "expr" (tpl $r.expr $ctx) "labels" $labels "annotations" $annotations -}}
{{- with get $custom "for" | default (get $r "for") }}{{ $_ := set $rule "for" . }}{{ end -}}
{{- $rules = append $rules $rule -}}
{{- end -}}
{{- end -}}
{{- if $rules }}{{ $groups = append $groups (dict "name" $g.name "rules" $rules) }}{{ end -}}
{{- end -}}
{{- range $name, $_ := $pr.disabled -}}
{{- if not (has $name $alerts) -}}
{{- fail (printf "metrics.prometheusRule.disabled: %s is no alert of the chart (%s)" $name (join ", " $alerts)) -}}
{{- end -}}
{{- end -}}
{{- range $name, $_ := $pr.customRules -}}
{{- if not (has $name $alerts) -}}
{{- fail (printf "metrics.prometheusRule.customRules: %s is no alert of the chart (%s)" $name (join ", " $alerts)) -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "groups" $groups) -}}
{{- end -}}
